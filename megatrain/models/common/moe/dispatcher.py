"""The single-process token dispatcher of a mixture-of-experts layer: capacity and token dropping,
the permutation of the tokens into rows grouped by expert, and the weighted un-permutation of the
experts' outputs. The token functions are in :mod:`megatrain.models.common.moe.token_ops`.

Interface (what ``MoELayer.forward`` calls, and what an expert-parallel dispatcher keeps)::

    expert_input, tokens_per_expert = dispatcher.dispatch(x [T, h], probs [T, E], routing_map [T, E])
    out = experts(expert_input, tokens_per_expert)      # rows grouped by local expert, in order
    y = dispatcher.combine(out)                          # [T, h]: sum over its experts of weight x output

For expert-parallel dispatchers (``megatrain.parallel.expert_dispatch``) the steps are separate:

* :meth:`LocalDispatcher.drop` -- capacity and token dropping / padding over **all** experts, on the
  tokens this rank routes (Megatron does it in the router, on each rank's own tokens): returns the new
  probs and map, and the capacity (None: dropless);
* :meth:`LocalDispatcher.permute` -- the local permutation of tokens (e.g. gathered from the expert
  group) for the experts ``expert_range`` (default: the dispatcher's ``local_expert_start`` ...
  ``+ num_local_experts``): rows in expert-major order and their counts; it keeps the permutation
  state (token index, row weights, number of tokens) for :meth:`unpermute`;
* :meth:`LocalDispatcher.unpermute` (= :meth:`combine`) -- the weighted sum back to one row per token
  of the last :meth:`permute` call.

``dispatch`` = ``drop`` then ``permute`` over the dispatcher's experts. Attributes: ``num_experts``
(E, all experts), ``local_expert_start`` and ``num_local_experts`` (the experts whose rows
``dispatch`` returns: all of them here), ``topk``, ``capacity_factor``, ``pad_to_capacity``,
``drop_policy``.

The dispatcher is an ``nn.Module`` without parameters (so it shows in the module tree as
``mlp.dispatcher`` and a wrapper can hold it as a submodule); its state lives from ``dispatch`` to
``combine`` of one forward (also of a recomputation forward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatrain.models.common.moe import token_ops

__all__ = ["LocalDispatcher"]


class LocalDispatcher(nn.Module):
    """All experts on this process (see the module docstring). ``expert_range`` (start, stop):
    the experts whose rows :meth:`dispatch` returns (default all)."""

    def __init__(self, config: Any, expert_range: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.num_experts: int = config.num_moe_experts
        self.topk: int = config.moe_router_topk
        self.capacity_factor: float | None = config.moe_expert_capacity_factor
        self.pad_to_capacity: bool = bool(config.moe_pad_expert_input_to_capacity)
        self.drop_policy: str = config.moe_token_drop_policy
        start, stop = expert_range if expert_range is not None else (0, self.num_experts)
        assert 0 <= start < stop <= self.num_experts, (start, stop, self.num_experts)
        self.local_expert_start, self.num_local_experts = start, stop - start
        self._state: tuple[torch.Tensor, torch.Tensor, int, bool] | None = None

    def extra_repr(self) -> str:
        drop = (f"capacity_factor={self.capacity_factor}, drop_policy={self.drop_policy}"
                + (", pad_to_capacity" if self.pad_to_capacity else "") if self.capacity_factor is not None
                else "dropless")
        return f"experts={self.local_expert_start}..{self.local_expert_start + self.num_local_experts - 1}, {drop}"

    # ---- the steps ---------------------------------------------------------------------------------

    def capacity(self, num_tokens: int) -> int | None:
        """Each expert's capacity for ``num_tokens`` routed tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return token_ops.expert_capacity(num_tokens, self.num_experts, self.topk, self.capacity_factor)

    def drop(self, probs: torch.Tensor, routing_map: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """Token dropping over all experts: (probs, routing_map, capacity); unchanged when dropless."""
        capacity = self.capacity(routing_map.shape[0])
        if capacity is None:
            return probs, routing_map, None
        probs, routing_map = token_ops.drop_tokens(probs, routing_map, capacity, self.drop_policy,
                                                   self.pad_to_capacity)
        return probs, routing_map, capacity

    def permute(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, *,
                capacity: int | None = None, expert_range: tuple[int, int] | None = None,
                num_out: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``x`` [T, h] for the experts of ``expert_range`` (columns of ``probs`` /
        ``routing_map`` [T, E]), expert-major: (rows [N, h], tokens_per_expert [E_local] long, on the
        device). ``capacity`` (padded layout): exactly that many rows per expert (the map marks
        ``min(capacity, T)`` tokens per expert). ``num_out``: the number of marked pairs if known
        (otherwise read once on the host, except when the range covers all experts dropless:
        ``T * topk``)."""
        start, stop = expert_range if expert_range is not None else (
            self.local_expert_start, self.local_expert_start + self.num_local_experts)
        num_tokens = x.shape[0]
        local_map, local_probs = routing_map[:, start:stop], probs[:, start:stop]
        if capacity is not None and self.pad_to_capacity:
            rows, row_probs, token_index = token_ops.permute_to_capacity(x, local_map, local_probs, capacity)
            tokens_per_expert = torch.full((stop - start,), capacity, dtype=torch.long, device=x.device)
            pad_row = capacity > num_tokens
        else:
            nothing_dropped = capacity is None or capacity >= num_tokens
            if num_out is None and nothing_dropped and (start, stop) == (0, self.num_experts):
                num_out = num_tokens * self.topk  # every token has its top-k experts
            rows, row_probs, token_index = token_ops.permute(x, local_map, local_probs, num_out)
            tokens_per_expert = local_map.sum(dim=0, dtype=torch.long)
            pad_row = False
        assert row_probs is not None
        self._state = (token_index, row_probs, num_tokens, pad_row)
        return rows, tokens_per_expert

    def unpermute(self, out: torch.Tensor) -> torch.Tensor:
        """[T, h] of the last :meth:`permute`: each token's expert outputs ``out`` [N, h] times their
        weights, summed (in ``out``'s dtype; see :func:`token_ops.unpermute`)."""
        assert self._state is not None, "combine() / unpermute() without dispatch() / permute()"
        token_index, row_probs, num_tokens, pad_row = self._state
        self._state = None
        return token_ops.unpermute(out, token_index, num_tokens, row_probs, pad_row)

    # ---- the layer's interface ------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``drop`` then ``permute``: (expert input [N, h], tokens_per_expert [E_local])."""
        probs, routing_map, capacity = self.drop(probs, routing_map)
        return self.permute(x, probs, routing_map, capacity=capacity)

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """The experts' outputs back to one row per token (see :meth:`unpermute`)."""
        return self.unpermute(out)
