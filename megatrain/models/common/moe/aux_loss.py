"""The router's balancing losses (Megatron-LM's ``moe_utils``) and how their gradients get in.

Formulas (``T`` tokens, ``E`` experts, ``k`` = top-k):

* switch load balancing (``aux_loss``): ``E * coeff / (k * T^2) * sum_e P_e * f_e`` with ``P_e`` the
  sum of expert ``e``'s scores over this rank's tokens and ``f_e`` the number of tokens routed to
  ``e`` over the ranks holding the other tokens of the same sequences (``T`` counts those too);
* ``seq_aux_loss``: the same per sequence, averaged over the micro-batch's sequences;
* ``global_aux_loss``: the same with the counts accumulated over the iteration's micro-batches (and
  the data-parallel ranks): the router keeps the running sums;
* z-loss: ``coeff * mean_t logsumexp(logits_t)^2``.

The counts are constants of the loss (no gradient flows through them): :func:`weighted_sum` keeps
them on its autograd node instead of saving them, so that activation recomputation (which re-runs
the forward inside the backward) cannot change them.

A loss enters the backward through :func:`attach_aux_loss`, Megatron's ``MoEAuxLossAutoScaler``: the
activation passes unchanged, and its backward adds ``d loss / d .`` times the scale of the main
loss's backward, which the trainer sets with :func:`set_aux_loss_scale` (the factor it multiplies
the micro-batch loss by: loss scale / micro-batches ...). The scale is read when the backward runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatrain.compiler_disable import compiler_disable

__all__ = ["set_aux_loss_scale", "aux_loss_scale", "attach_aux_loss", "weighted_sum", "switch_load_balancing_loss",
           "sequence_load_balancing_loss", "z_loss", "routing_scores_for_aux_loss", "group_size",
           "tokens_per_expert"]

_SCALE: dict[str, Any] = {"value": 1.0, "tensors": {}}  # the python value and its copies per device


def set_aux_loss_scale(weight: float | torch.Tensor) -> None:
    """The factor the trainer multiplies each micro-batch's loss by in its backward; the balancing
    losses' gradients are multiplied by it too. Queues no host sync (the device copies are filled)."""
    value = float(weight) if not isinstance(weight, torch.Tensor) else weight
    _SCALE["value"] = value
    for tensor in _SCALE["tensors"].values():
        tensor.copy_(value) if isinstance(value, torch.Tensor) else tensor.fill_(value)


def aux_loss_scale(device: torch.device | str = "cpu") -> torch.Tensor:
    """The current scale as a float32 scalar on ``device`` (one tensor per device, refilled in place
    by :func:`set_aux_loss_scale`, so a recorded CUDA graph reads the current value)."""
    key = str(torch.device(device))
    tensor = _SCALE["tensors"].get(key)
    if tensor is None:
        value = _SCALE["value"]
        tensor = (value.detach().to(device=device, dtype=torch.float32).reshape(()).clone()
                  if isinstance(value, torch.Tensor) else torch.full((), value, dtype=torch.float32, device=device))
        _SCALE["tensors"][key] = tensor
    return tensor


class _AuxLossScaler(torch.autograd.Function):
    """Forward: the activation unchanged. Backward: the activation's gradient, and the scale as the
    loss's gradient (its shape only is kept: no tensor is saved)."""

    @staticmethod
    def forward(ctx: Any, activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return activation

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.loss_meta
        return grad, aux_loss_scale(device).to(dtype).expand(shape).clone()


@compiler_disable  # eager: the backward must read the scale set after the forward
def attach_aux_loss(activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``activation`` whose backward also back-propagates ``loss`` (times the current aux-loss scale)."""
    return _AuxLossScaler.apply(activation, loss)


class _ConstWeightedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight, ctx.shape = weight, x.shape  # kept on the node, not saved (see the module doc)
        return (x * weight).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (grad * ctx.weight).expand(ctx.shape).to(grad.dtype), None


def weighted_sum(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(x * weight).sum()`` with ``weight`` (broadcast to ``x``) a constant of the graph."""
    return _ConstWeightedSum.apply(x, weight.detach().to(x.dtype))


def group_size(group: Any) -> int:
    """Ranks in ``group`` (None: one process)."""
    return 1 if group is None else dist.get_world_size(group)


def tokens_per_expert(routing_map: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Tokens routed to each expert (float32): ``routing_map`` [..., T, E] summed over its token dim
    and over ``group``'s ranks (no gradient)."""
    counts = routing_map.sum(dim=-2, dtype=torch.float32)
    if group_size(group) > 1:
        dist.all_reduce(counts, group=group)
    return counts


def switch_load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, total_tokens: int | float,
                               topk: int, coeff: float) -> torch.Tensor:
    """Megatron's ``switch_load_balancing_loss_func``: ``scores`` [T, E] this rank's full scores,
    ``counts`` [E] the routed tokens per expert over ``total_tokens`` tokens."""
    num_experts = scores.shape[-1]
    factor = num_experts * coeff / (topk * float(total_tokens) * float(total_tokens))
    return weighted_sum(scores, counts.reshape(1, -1) * factor)


def sequence_load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, total_tokens: int | float,
                                 topk: int, coeff: float) -> torch.Tensor:
    """Megatron's ``seq_aux_loss``: the switch loss of each sequence averaged over the sequences.
    ``scores`` [b, s, E] (this rank's tokens of each sequence), ``counts`` [b, E] routed tokens per
    sequence and expert over ``total_tokens`` tokens of a sequence."""
    b, _, num_experts = scores.shape
    factor = num_experts * coeff / (topk * float(total_tokens) * float(total_tokens) * b)
    return weighted_sum(scores, counts.reshape(b, 1, num_experts) * factor)


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * mean over tokens of logsumexp(logits)^2`` (ST-MoE), in float32."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean() * coeff


def routing_scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``compute_routing_scores_for_aux_loss``: (the plain top-k routing map [T, E] bool,
    the scores over all experts [T, E] float32: softmax, or sigmoid / sqrt-softplus normalised to sum 1)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        raw = torch.sigmoid(logits.float()) if score_function == "sigmoid" else \
            torch.nn.functional.softplus(logits.float()).sqrt()
        scores = raw / (raw.sum(dim=-1, keepdim=True) + 1e-20)
    top = torch.topk(scores, k=topk, dim=-1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, top, True)
    return routing_map, scores
