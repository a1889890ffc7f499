"""Multi-token prediction (DeepSeek-V3; Megatron-LM's ``--mtp-num-layers``, ``--mtp-loss-scaling-factor``).

After the decoder, ``D`` depths each predict one token further. Depth ``k`` (0-based) takes the hidden
states of the depth before (the decoder's final-normed output for ``k = 0``) and the embeddings of the
input tokens shifted left by ``k + 1``; it normalises both (``hnorm``, ``enorm``), concatenates them
(embedding first), projects ``2h -> h`` (``eh_proj``), runs one transformer layer of the decoder's last
layer's kind (dense or MoE: ``transformer_layer``) and normalises (``final_layernorm``). The model's
output layer turns that into logits for the labels shifted by ``k + 1`` more. Module paths are
``mtp.layers.<k>.{enorm, hnorm, eh_proj, transformer_layer, final_layernorm}``.

Shifting is Megatron's ``roll_tensor``: left by one per depth, the vacated last positions filled with
0 (token 0, loss mask 0). The shifted tokens, labels and loss masks are batch fields
(:func:`megatrain.data.batch.mtp_fields`, computed from the whole sequence before a context-parallel
split), with each sample's loss-token counts (the unshifted mask's, then every depth's), so a depth's
loss is normalised by its micro-batch's count whatever the layout.

The depths' losses do not change the logged ``lm loss``. They enter the backward as Megatron's
``MTPLossAutoScaler`` does: the main per-token loss carries ``factor / D * sum_k L_k``
(:func:`megatrain.models.common.moe.aux_loss.attach_aux_loss`, scaled as the main loss's backward is),
with ``L_k = sum(mask_k * ce_k) / n_k`` per micro-batch, or, with ``--calculate-per-token-loss``,
``L_k = sum(mask_k * ce_k) * n_0 / n_k`` (the trainer divides every gradient by the global token count).
Each depth's mean loss is logged as ``mtp_<k+1> loss`` (:class:`MtpMetrics`). Evaluation and
generation run the decoder alone.

``--mtp-use-repeated-layer``: one depth's modules (``mtp.layers.0``) run for every depth.
``--mtp-detach-heads``: the depths' loss trains the depths alone: the decoder's output and the embeddings
they take are detached, and their logits use a detached output weight (Megatron's ``mtp_detach_heads``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from megatrain.models.common.config import TransformerConfig
from megatrain.models.common.moe.aux_loss import attach_aux_loss
from megatrain.models.common.norms import build_norm
from megatrain.models.common.transformer_layer import TransformerLayer

__all__ = ["MtpLayer", "MultiTokenPrediction", "MtpMetrics", "DetachedOutput", "mtp_modules"]


class MtpLayer(nn.Module):
    """One prediction depth: norms of the hidden states and of the next tokens' embeddings, their
    projection, a transformer layer, a final norm."""

    def __init__(self, config: TransformerConfig, depth: int) -> None:
        super().__init__()
        self.enorm = build_norm(config)
        self.hnorm = build_norm(config)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.transformer_layer = TransformerLayer(config, layer_number=config.num_layers + depth)
        self.final_layernorm = build_norm(config)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, position_ids: torch.Tensor | None,
                attention_mask: torch.Tensor | None, rotary: Any = None) -> torch.Tensor:
        mixed = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.final_layernorm(self.transformer_layer(mixed, position_ids, attention_mask, rotary=rotary))


class DetachedOutput:
    """A model's output layer with its weight (and bias) detached: what the depths' logits use under
    ``--mtp-detach-heads`` (the loss-head protocol of :mod:`megatrain.models.common.heads`)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def output_weight(self) -> torch.Tensor:
        return self.model.output_weight().detach()

    def output_bias(self) -> torch.Tensor | None:
        bias = self.model.output_bias()
        return None if bias is None else bias.detach()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.output_weight(), self.output_bias())


class MultiTokenPrediction(nn.Module):
    """The ``D`` depths (``layers``: one per depth, or one run for all with ``--mtp-use-repeated-layer``),
    their loss and the values they log."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.depths = config.mtp_num_layers
        self.loss_factor = config.mtp_loss_scaling_factor
        self.detach_heads = config.mtp_detach_heads
        self.layers = nn.ModuleDict({str(k): MtpLayer(config, k) for k in range(config.mtp_built_layers)})
        self.calculate_per_token_loss = False  # set by MtpMetrics from --calculate-per-token-loss
        # each depth's mean loss summed over the iteration's micro-batches (on the device; MtpMetrics reads it)
        self.logged: torch.Tensor | None = None

    def attach_loss(self, main_loss: torch.Tensor, hidden: torch.Tensor, targets: dict[str, torch.Tensor], *,
                    embed: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
                    per_token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                    rotary: Any = None) -> torch.Tensor:
        """``main_loss`` [b, s] carrying the depths' loss into the backward. ``hidden``: the decoder's
        final-normed output; ``targets``: the batch's :func:`~megatrain.data.batch.mtp_fields`; ``embed(ids,
        position_ids)`` the model's embedding, ``per_token_loss(hidden, labels)`` its output layer and
        cross entropy (with ``--mtp-detach-heads``, a :class:`DetachedOutput`'s)."""
        counts = targets["mtp_counts"].sum(dim=0)  # [D + 1] over the micro-batch
        total, means = main_loss.new_zeros(()), []
        if self.detach_heads:
            hidden = hidden.detach()
        layers = list(self.layers.values())
        for k in range(self.depths):
            layer = layers[min(k, len(layers) - 1)]  # --mtp-use-repeated-layer: the one layer every time
            embedded = embed(targets["mtp_tokens"][..., k], position_ids)
            if self.detach_heads:
                embedded = embedded.detach()
            hidden = layer(hidden, embedded, position_ids, attention_mask, rotary)
            ce = per_token_loss(hidden, targets["mtp_labels"][..., k])
            loss_sum = (ce * targets["mtp_loss_mask"][..., k].to(ce.dtype)).sum()
            count = counts[k + 1].clamp(min=1.0)
            means.append(loss_sum.detach() / count)
            total = total + (loss_sum * counts[0] / count if self.calculate_per_token_loss else loss_sum / count)
        self._log(torch.stack(means))
        return attach_aux_loss(main_loss, total * (self.loss_factor / self.depths))

    @torch.no_grad()
    def _log(self, means: torch.Tensor) -> None:
        if self.logged is None or self.logged.device != means.device:
            self.logged = torch.zeros_like(means)
        self.logged.add_(means)


def mtp_modules(modules: nn.Module | Iterable[nn.Module]) -> list[MultiTokenPrediction]:
    """Every :class:`MultiTokenPrediction` in ``modules`` (a model, or this rank's pipeline stages)."""
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    return [m for root in roots for m in root.modules() if isinstance(m, MultiTokenPrediction)]


class MtpMetrics:
    """The trainer's multi-token prediction bookkeeping (the depths' losses take the main loss's backward
    factor through :func:`~megatrain.models.common.moe.aux_loss.set_aux_loss_scale`, set by the trainer): their
    logged losses (Megatron's ``mtp_<k> loss``: each micro-batch's mean, averaged over the
    micro-batches, then the context-parallel parts summed and the data-parallel ranks averaged by the
    caller's ``reduce``)."""

    def __init__(self, modules: nn.Module | Iterable[nn.Module], depths: int, *, device: torch.device | str = "cpu",
                 per_token_loss: bool = False) -> None:
        self.blocks = mtp_modules(modules)
        for block in self.blocks:
            block.calculate_per_token_loss = per_token_loss
        self.names = tuple(f"mtp_{k + 1} loss" for k in range(depths))
        self.device = torch.device(device)
        self._interval = torch.zeros(depths, device=self.device, dtype=torch.float32)
        self.iterations = 0

    @classmethod
    def for_model(cls, modules: nn.Module | Iterable[nn.Module], config: Any, **kwargs: Any) -> "MtpMetrics | None":
        """The bookkeeping of a model with prediction depths; None without (which pays nothing)."""
        depths = getattr(config, "mtp_num_layers", 0) or 0
        return cls(modules, depths, **kwargs) if depths else None


    def after_backward(self, num_micro_batches: int) -> None:
        """After the iteration's backward: its mean losses added to the interval's (device work only)."""
        for block in self.blocks:
            if block.logged is not None:
                self._interval.add_(block.logged.to(self.device), alpha=1.0 / max(num_micro_batches, 1))
                block.logged.zero_()
        self.iterations += 1

    def read(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """The interval's mean losses by name (then the interval starts again); ``reduce`` sums the
        context-parallel parts and pipeline stages and averages the data-parallel ranks (a collective:
        every rank calls it at the same iteration)."""
        values = reduce(self._interval / max(self.iterations, 1)).tolist()
        self._interval.zero_()
        self.iterations = 0
        return dict(zip(self.names, values))
