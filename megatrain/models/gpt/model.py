"""GPTModel: the decoder-only transformer family (GPT-2 style and LLaMA style) as plain PyTorch.

Module paths are a contract shared with the parallelism, checkpoint and conversion code:

    embedding.word_embeddings, embedding.position_embeddings (learned_absolute only)
    layers["0"...]: input_layernorm, self_attention.{linear_qkv, linear_proj, and with --qk-layernorm
                    q_layernorm, k_layernorm},
                    pre_mlp_layernorm, mlp.{linear_fc1, linear_fc2}; in a mixture-of-experts layer
                    (--num-experts, --moe-layer-freq) mlp.{router, experts.{linear_fc1, linear_fc2},
                    shared_experts.{linear_fc1, linear_fc2, gate_weight}} (models/common/moe/layer.py)
    final_layernorm, output_layer (only with untie_embeddings_and_output_weights)
    mtp.layers["0"...]: enorm, hnorm, eh_proj, transformer_layer, final_layernorm (--mtp-num-layers;
                    megatrain/models/gpt/mtp.py)

Activations are batch-first: hidden states are [b, s, h].

Initialisation is a pure function of (seed, parameter name, shape): ``initial_value`` gives the
same full tensor whatever the device or parallel layout, so a model built on the meta device and
sharded afterwards starts from exactly the same weights as one built whole on one device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.models.common.attention import KVCache
from megatrain.models.common.embedding import Embedding
from megatrain.models.common.heads import LogitsCrossEntropy, LossHead, per_token_cross_entropy
from megatrain.models.common.init import canonical_parameter_name, megatron_initial_value
from megatrain.models.common.norms import build_norm
from megatrain.models.common.rope import rotary_tables
from megatrain.models.common.transformer_layer import TransformerLayer
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt.mtp import DetachedOutput, MultiTokenPrediction

__all__ = ["GPTModel", "TransformerLayer", "Embedding", "KVCache", "initial_value", "canonical_parameter_name"]


class GPTModel(nn.Module):
    """Decoder-only transformer language model.

    A model built on a real device is initialised with ``init_weights(seed=0)``; training code
    calls ``init_weights(args.seed)`` itself (and must, after building on the meta device).

    For pipeline stages, ``embedding`` may be set to None (the stage then takes hidden states
    [b, s, h] as ``input_ids``) and ``final_layernorm`` to None (the stage returns hidden states).

    ``loss_head`` (see :mod:`megatrain.models.common.heads`) turns the final normed hidden states
    and the labels into the per-token loss: the plain logits-then-cross-entropy by default; parallel
    code may put the chunked float32 head (``--cross-entropy-chunk-size``) or the vocab-parallel
    one there.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding: Embedding | None = Embedding(config)
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(config, layer_number=i) for i in range(config.num_layers)}
        )
        self.final_layernorm: nn.Module | None = build_norm(config)
        self.output_layer = (
            nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if config.untie_embeddings_and_output_weights
            else None
        )
        self.mtp = MultiTokenPrediction(config) if config.mtp_num_layers else None
        self.loss_head: LossHead = LogitsCrossEntropy()
        if not next(self.parameters()).is_meta:
            self.init_weights(seed=0)

    # ---- the pieces parallel code wraps -------------------------------------------------------

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [b, s] -> hidden states [b, s, h] (with embedding dropout).

        Under autocast the result is in the autocast dtype, so the residual stream between the
        layers is too (Megatron's default; ``fp32_residual_connection`` keeps float32)."""
        assert self.embedding is not None
        hidden = self.embedding(input_ids, position_ids)
        device_type = hidden.device.type
        if not self.config.fp32_residual_connection and torch.is_autocast_enabled(device_type):
            hidden = hidden.to(torch.get_autocast_dtype(device_type))
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states [b, s, h] -> logits [b, s, V] (the output layer, or the word
        embeddings when tied)."""
        if self.output_layer is not None:
            return self.output_layer(hidden)
        assert self.embedding is not None, "tied output weights need the word embeddings"
        return F.linear(hidden, self.embedding.word_embeddings.weight)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last layer's hidden states [b, s, h] -> final norm -> logits [b, s, V]."""
        assert self.final_layernorm is not None
        return self.logits(self.final_layernorm(hidden))

    def head(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Last layer's hidden states -> final norm -> logits, or with ``labels`` the per-token
        loss of ``loss_head``."""
        assert self.final_layernorm is not None
        hidden = self.final_layernorm(hidden)
        if labels is None:
            return self.logits(hidden)
        return self.loss_head.per_token_loss(self, hidden, labels)

    def head_with_mtp(self, hidden: torch.Tensor, labels: torch.Tensor, mtp_targets: dict[str, torch.Tensor] | None,
                      position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                      rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """As :meth:`head` with ``labels``; in training with multi-token prediction and its batch fields
        (``mtp_targets``), the per-token loss also carries the prediction depths' loss into the backward."""
        if self.mtp is None or mtp_targets is None or not self.training:
            return self.head(hidden, labels)
        assert self.final_layernorm is not None
        normed = self.final_layernorm(hidden)
        loss = self.loss_head.per_token_loss(self, normed, labels)
        output = DetachedOutput(self) if self.mtp.detach_heads else self
        return self.mtp.attach_loss(loss, normed, mtp_targets, embed=self.embed,
                                    per_token_loss=lambda h, y: self.loss_head.per_token_loss(output, h, y),
                                    position_ids=position_ids, attention_mask=attention_mask, rotary=rotary)

    def extra_transformer_layers(self) -> list[nn.Module]:
        """The multi-token prediction depths' transformer layers (run after ``layers``)."""
        return [getattr(parent, attr) for _, parent, attr in self.extra_transformer_layer_slots()]

    def extra_transformer_layer_slots(self) -> list[tuple[str, nn.Module, str]]:
        """Where those layers sit: (path, the depth holding it, its attribute), for code that replaces them."""
        if self.mtp is None:
            return []
        return [(f"mtp.layers.{k}.transformer_layer", depth, "transformer_layer")
                for k, depth in self.mtp.layers.items()]

    def output_weight(self) -> torch.Tensor:
        """The output layer's weight [V, h]: its own, or the word embeddings' when tied."""
        if self.output_layer is not None:
            return self.output_layer.weight
        assert self.embedding is not None, "tied output weights need the word embeddings"
        return self.embedding.word_embeddings.weight

    def output_bias(self) -> None:
        """GPT's output layer has no bias."""
        return None

    loss = staticmethod(per_token_cross_entropy)

    # ---- forward ------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        *,
        decoder_input: torch.Tensor | None = None,
        logit_positions: torch.Tensor | None = None,
        mtp_targets: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits [b, s, V], or with ``labels`` the per-token loss [b, s] in float32.

        position_ids default to 0..s-1, shifted by the tokens already in ``kv_cache``.
        attention_mask: None means causal; else bool [b, 1, s, past + s], True = may attend.
        decoder_input: hidden states [b, s, h] that the first layer takes instead of the embedded
        ``input_ids`` (which may then be None), as Megatron's ``decoder_input``: a vision-language
        model's text embeddings with image features in place (``megatrain.models.llava``).
        logit_positions: int64 [n] indices into the sequence: only those positions' logits are
        computed, [b, n, V] (an inference prefill reads each prompt's last one, not all s x V).
        mtp_targets: the batch's multi-token prediction fields (:func:`megatrain.data.batch.mtp_fields`),
        with ``labels`` in training.
        """
        first = input_ids if decoder_input is None else decoder_input
        seq_length = first.shape[1]
        past = kv_cache.length if kv_cache is not None else 0
        if position_ids is None:
            if (
                self.config.position_embedding_type == "learned_absolute"
                and past + seq_length > self.config.max_position_embeddings
            ):
                raise ValueError(
                    f"sequence of {past + seq_length} tokens is longer than "
                    f"--max-position-embeddings ({self.config.max_position_embeddings})"
                )
            position_ids = torch.arange(past, past + seq_length, device=first.device).unsqueeze(0)

        if decoder_input is not None:
            hidden = decoder_input
        else:
            hidden = self.embed(input_ids, position_ids) if self.embedding is not None else input_ids
        rotary = rotary_tables(self.config, position_ids)  # once for all layers
        for layer in self.layers.values():
            hidden = layer(hidden, position_ids, attention_mask, kv_cache, rotary=rotary)
        if self.final_layernorm is None:
            return hidden
        if logit_positions is not None:
            assert labels is None, "logit_positions is for logits, not a loss"
            hidden = hidden.index_select(1, logit_positions)
        if labels is not None:
            return self.head_with_mtp(hidden, labels, mtp_targets, position_ids, attention_mask, rotary)
        return self.head(hidden)

    # ---- parameters -----------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter with ``initial_value`` (also right after meta -> ``to_empty``)."""
        for name, param in self.named_parameters():
            param.copy_(initial_value(name, param.shape, self.config, seed))

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (a tied output weight counts once).

        exclude_embeddings leaves out word and position embeddings and an untied output layer.
        """
        total = sum(p.numel() for p in self.parameters())
        if not exclude_embeddings:
            return total
        embedding_layers = [self.output_layer]
        if self.embedding is not None:
            embedding_layers += [self.embedding.word_embeddings, self.embedding.position_embeddings]
        return total - sum(layer.weight.numel() for layer in embedding_layers if layer is not None)


# ---- deterministic initialisation ---------------------------------------------------------------

# Mixture-of-experts layers: the router's weight [E, h], the experts' linear_fc1 [E, 2F, h] (their
# linear_fc2 [E, h, F] is a residual projection) and the shared experts' gate_weight [1, h], as Megatron's
# init_method; each seeded by its full name, so the whole [E, ...] tensor is the same for any expert layout.
# Multi-latent attention's query and key/value projections are init_method weights too (Megatron's).
_STD_WEIGHTS = frozenset({"linear_qkv", "linear_fc1", "word_embeddings", "position_embeddings", "output_layer",
                          "eh_proj", "router", "gate_weight", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                          "linear_kv_down_proj", "linear_kv_up_proj"})


def initial_value(name: str, shape: Sequence[int], config: GPTConfig, seed: int) -> torch.Tensor:
    """The initial value of GPT parameter ``name`` (see :func:`megatron_initial_value`): linear
    layers and embeddings N(0, std), linear_proj and linear_fc2 N(0, std / sqrt(2 L)), biases 0,
    norm weights 1 (0 with ``--apply-layernorm-1p``); in MoE layers the router, the experts'
    linear_fc1 and the shared-expert gate N(0, std), the experts' linear_fc2 N(0, std / sqrt(2 L))."""
    return megatron_initial_value(name, shape, config, seed, std_weights=_STD_WEIGHTS)
