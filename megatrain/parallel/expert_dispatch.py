"""Expert-parallel token dispatchers: the collectives that move a mixture-of-experts layer's tokens to
the ranks holding their experts and back, with autograd.

Each rank routes only its own tokens (its batch, its sequence part under sequence / context
parallelism). The ``ep`` ranks of one expert group hold ``E / ep`` experts each (rank ``r``: experts
``r * E/ep ... (r+1) * E/ep - 1``). Both dispatchers keep the interface of the single-process
:class:`~megatrain.models.common.moe.dispatcher.LocalDispatcher` (``dispatch`` -> expert input rows
grouped by local expert and their counts, ``combine`` -> one output row per token), so the layer's
forward is the same code in every layout:

``alltoall`` (:class:`AllToAllDispatcher`)
    the local tokens permuted by global expert (the local dispatcher's permutation, capacity and
    token dropping included), the tokens-per-expert counts exchanged (one small all-to-all; the split
    sizes are then read on the host, as Megatron does), the rows sent with ``all_to_all_single`` and
    sorted by local expert; ``combine`` reverses the sort and the exchange, then the local
    dispatcher's weighted un-permutation.
``allgather`` (:class:`AllGatherDispatcher`)
    tokens, probabilities and routing map of the whole expert group all-gathered (token dropping
    first, on each rank's own tokens, as Megatron's router does), the local experts' tokens permuted
    out of them; ``combine`` un-permutes into all the group's tokens and reduce-scatters the sums
    back. Backward: reduce-scatter / all-gather.

``grad_scale`` (both): the expert weights' gradient is multiplied by it and nothing else (an identity
on the experts' input whose backward divides by it, and one on their output whose backward
multiplies): how :func:`megatrain.parallel.expert_parallel.apply_expert_parallel` corrects the
average that FSDP2 takes over the expert-data-parallel ranks (see there).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torch import nn

__all__ = ["all_to_all", "all_gather", "reduce_scatter", "scale_grad", "AllToAllDispatcher",
           "AllGatherDispatcher", "ScaledGradDispatcher", "sort_chunks"]


# ---- collectives with autograd ----------------------------------------------------------------------

# Newer torch names the tensor collectives *_single (the *_tensor names warn); older torch has only those.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_from = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 with split sizes; backward: the exchange reversed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any
                ) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


class _AllGather(torch.autograd.Function):
    """Equal-sized all-gather along dim 0 (rank order); backward: reduce-scatter of the sums."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        _gather_into(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    """Sum over the group, each rank keeping its equal part of dim 0; backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _AllGather.forward(ctx, grad, ctx.group), None


def _reduce_scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
    n = dist.get_world_size(group)
    assert x.shape[0] % n == 0, (x.shape, n)
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    _scatter_from(out, x.contiguous(), group=group)
    return out


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad * ctx.scale, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
    """Rows ``x`` [sum(input_splits), ...] exchanged over ``group``: ``input_splits[r]`` rows go to rank
    r, ``output_splits[r]`` come from it (rank order); differentiable."""
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


def all_gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``x`` (equal shapes) concatenated along dim 0 in rank order; differentiable."""
    return _AllGather.apply(x, group)


def reduce_scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over ``group``, rank r keeping rows ``r * n/size ... (r+1) * n/size``; differentiable."""
    return _ReduceScatter.apply(x, group)


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` itself, whose gradient is multiplied by ``scale`` (nothing happens for 1)."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, float(scale))


def sort_chunks(counts: list[list[int]]) -> torch.Tensor:
    """The row order that turns chunks laid out ``[source][expert]`` (sizes ``counts``) into
    ``[expert][source]``: index ``i`` of the result is the old row that goes to new row ``i``."""
    starts, offset = [], 0
    for row in counts:
        starts.append([])
        for n in row:
            starts[-1].append(offset)
            offset += n
    order = [torch.arange(starts[s][e], starts[s][e] + counts[s][e])
             for e in range(len(counts[0]) if counts else 0) for s in range(len(counts))]
    return torch.cat(order) if order else torch.zeros(0, dtype=torch.long)


# ---- dispatchers ----------------------------------------------------------------------------------

class _Wrapping(nn.Module):
    """A dispatcher built around the layer's local one (``local``: its capacity, dropping and
    permutation code over all experts), holding no parameters."""

    def __init__(self, local: nn.Module, grad_scale: float = 1.0) -> None:
        super().__init__()
        self.local = local
        self.grad_scale = float(grad_scale)


class ScaledGradDispatcher(_Wrapping):
    """The local dispatcher (all experts on this rank) with the experts' weight gradients scaled by
    ``grad_scale``: what an expert-parallel size of 1 needs under tensor or data parallelism (the
    experts' gradients are reduced over all the stage's ranks)."""

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        expert_input, tokens_per_expert = self.local.dispatch(x, probs, routing_map)
        return scale_grad(expert_input, 1.0 / self.grad_scale), tokens_per_expert

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        return self.local.combine(scale_grad(out, self.grad_scale))


class AllToAllDispatcher(_Wrapping):
    """Tokens exchanged with all-to-all over the ``ep`` group (see the module docstring)."""

    def __init__(self, local: nn.Module, ep_group: Any, grad_scale: float = 1.0) -> None:
        super().__init__(local, grad_scale)
        self.ep_group = ep_group
        self.ep = dist.get_world_size(ep_group)
        self._exchange: tuple | None = None

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        local_experts = routing_map.shape[1] // self.ep
        # The local dispatcher's work over all experts: capacity, dropping, permutation by global expert.
        permuted, per_expert = self.local.dispatch(x, probs, routing_map)
        send = per_expert.reshape(self.ep, local_experts).to(torch.long)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.ep_group)
        # One host read of the sizes (the exchange allocates by them), as Megatron's dispatcher does.
        sizes = torch.cat([send.sum(1), recv.flatten()]).tolist()
        input_splits, recv_counts = sizes[:self.ep], sizes[self.ep:]
        counts = [recv_counts[r * local_experts:(r + 1) * local_experts] for r in range(self.ep)]
        output_splits = [sum(row) for row in counts]
        received = all_to_all(permuted, output_splits, input_splits, self.ep_group)
        order = None
        if local_experts > 1:
            order = sort_chunks(counts).to(received.device)
            received = received.index_select(0, order)
        self._exchange = (input_splits, output_splits, order)
        return scale_grad(received, 1.0 / self.grad_scale), recv.sum(0)

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        assert self._exchange is not None, "combine() without dispatch()"
        input_splits, output_splits, order = self._exchange
        self._exchange = None
        out = scale_grad(out, self.grad_scale)
        if order is not None:
            back = torch.empty_like(order)
            back[order] = torch.arange(order.numel(), device=order.device)
            out = out.index_select(0, back)
        return self.local.combine(all_to_all(out, input_splits, output_splits, self.ep_group))


class AllGatherDispatcher(_Wrapping):
    """The expert group's tokens all-gathered, the local experts' ones computed here, the outputs
    reduce-scattered back (see the module docstring)."""

    def __init__(self, local: nn.Module, ep_group: Any, grad_scale: float = 1.0) -> None:
        super().__init__(local, grad_scale)
        self.ep_group = ep_group
        self.ep = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        local_experts = routing_map.shape[1] // self.ep
        # Capacity and dropping on this rank's own tokens over all experts (as Megatron's router does).
        probs, routing_map, _ = self.local.drop(probs, routing_map)
        tokens = all_gather(x, self.ep_group)
        probs = all_gather(probs, self.ep_group)
        with torch.no_grad():
            routing_map = all_gather(routing_map.to(torch.uint8), self.ep_group).bool()
        first = self.ep_rank * local_experts
        # Padded maps (--moe-pad-expert-input-to-capacity) are computed as they are: their extra tokens
        # have weight 0, as in Megatron's all-gather dispatcher.
        expert_input, tokens_per_expert = self.local.permute(tokens, probs, routing_map,
                                                             expert_range=(first, first + local_experts))
        return scale_grad(expert_input, 1.0 / self.grad_scale), tokens_per_expert

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        gathered = self.local.combine(scale_grad(out, self.grad_scale))  # [ep * T, h], the local experts' part
        return reduce_scatter(gathered, self.ep_group)
