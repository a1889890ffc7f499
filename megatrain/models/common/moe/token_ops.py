"""Token movement of a mixture-of-experts layer as pure tensor functions (no process groups):
expert capacity, token dropping, the permutation of tokens into expert-major order and its weighted
inverse. Megatron-LM's ``moe_utils.py`` (``get_capacity``, ``apply_router_token_dropping``,
``permute``, ``unpermute``) is the specification; dispatchers (one process, or expert parallel) call
these.

Shapes: ``T`` tokens of width ``h``, ``E`` experts, ``probs`` [T, E] (zeros where a token is not
routed), ``routing_map`` [T, E] bool. The permuted rows are **expert-major**: expert 0's tokens in
token order, then expert 1's, ...; ``token_index`` [N] gives each row's source token.

Capacity (``--moe-expert-capacity-factor f``): ``C = ceil(T * topk / E * f)`` per expert, from the
number of tokens this call routes (Megatron's router applies it to each rank's own tokens). Beyond
it, tokens are dropped per expert:

* ``probs`` policy: each expert keeps its ``C`` routed tokens of highest routing weight;
* ``position`` policy: each expert keeps its first ``C`` routed tokens;

ties are broken by position (earlier first), so the choice is deterministic. A dropped token gets
no output from that expert (its weight there is 0; the other experts' weights are not renormalised,
as in Megatron). With ``--moe-pad-expert-input-to-capacity`` every expert gets exactly ``C`` rows:
Megatron fills an expert's free slots with tokens not routed to it (weight 0), chosen in the same
order; here too, and when ``C > T`` the remaining ``C - T`` rows are rows of zeros (the row index
``T`` stands for a zero token), so the shapes are static. Padding rows contribute nothing to the
output or to any gradient.

The dropless path (no capacity) reads nothing on the host: the number of rows is ``T * topk`` and
``tokens_per_expert`` stays a device tensor.
"""

from __future__ import annotations

import math

import torch

__all__ = ["expert_capacity", "capacity_mask", "drop_tokens", "permute", "permute_to_capacity", "unpermute",
           "DROP_POLICIES"]

DROP_POLICIES = ("probs", "position")


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float,
                    min_capacity: int | None = None) -> int:
    """Tokens each expert may take: ``ceil((num_tokens * topk / num_experts) * capacity_factor)``, at
    least ``min_capacity`` (Megatron's ``get_capacity`` over the ``num_tokens * topk`` routed slots)."""
    capacity = math.ceil((num_tokens * topk / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def _expert_order(probs: torch.Tensor, routing_map: torch.Tensor, policy: str) -> torch.Tensor:
    """[T, E]: column e lists the tokens in the order expert e keeps them: its routed tokens first
    (by weight, highest first, for ``probs``; by position for ``position``), then the others; ties by
    position."""
    if policy == "probs":
        key = probs.detach().float().masked_fill(~routing_map, -1.0)  # weights are >= 0
    elif policy == "position":
        key = routing_map.to(torch.int8)
    else:
        raise ValueError(f"--moe-token-drop-policy must be one of {', '.join(DROP_POLICIES)}, got {policy!r}")
    return torch.argsort(key, dim=0, descending=True, stable=True)


def capacity_mask(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, policy: str = "probs"
                  ) -> torch.Tensor:
    """[T, E] bool: the ``capacity`` first tokens of each expert in its keeping order (all tokens when
    ``capacity >= T``)."""
    num_tokens = routing_map.shape[0]
    if capacity >= num_tokens:
        return torch.ones_like(routing_map, dtype=torch.bool)
    keep = _expert_order(probs, routing_map, policy)[:capacity]  # [C, E] token ids
    return torch.zeros_like(routing_map, dtype=torch.bool).scatter(0, keep, True)


def drop_tokens(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, policy: str = "probs",
                pad_to_capacity: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) with each expert's tokens beyond ``capacity`` dropped (weight 0, map
    False). With ``pad_to_capacity`` the map instead marks exactly ``min(capacity, T)`` tokens per
    expert: the kept routed ones and, in the free slots, tokens not routed to it (weight 0)."""
    mask = capacity_mask(probs, routing_map, capacity, policy)
    new_map = mask if pad_to_capacity else routing_map & mask
    return probs * new_map, new_map


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None,
            num_out: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Rows of ``tokens`` [T, h] in expert-major order: (rows [N, h], their weights [N] (with
    ``probs``), token_index [N]). ``num_out`` is the number of routed (token, expert) pairs when the
    caller knows it (``T * topk`` without dropping); None counts them (one host read)."""
    num_tokens = routing_map.shape[0]
    flat_map = routing_map.t().reshape(-1)  # [E * T], expert-major
    if num_out is None:
        num_out = int(flat_map.sum().item())
    # A stable descending sort puts the routed pairs first, in (expert, token) order, with static shapes.
    flat = torch.argsort(flat_map.to(torch.int8), descending=True, stable=True)[:num_out]
    token_index = flat % num_tokens
    rows = tokens.index_select(0, token_index)
    row_probs = probs.t().reshape(-1).index_select(0, flat) if probs is not None else None
    return rows, row_probs, token_index


def permute_to_capacity(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None,
                        capacity: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Like :func:`permute` for a padded map (``min(capacity, T)`` marked tokens per expert, from
    :func:`drop_tokens` with ``pad_to_capacity``): exactly ``capacity`` rows per expert, the marked
    tokens in token order, then (when ``capacity > T``) zero rows, whose token index is ``T``."""
    num_tokens, num_experts = routing_map.shape
    marked = min(capacity, num_tokens)
    # stable: each expert's marked tokens first, in token order
    index = torch.argsort(routing_map.t().to(torch.int8), dim=1, descending=True, stable=True)[:, :marked]
    if capacity > num_tokens:
        pad = torch.full((num_experts, capacity - num_tokens), num_tokens, dtype=index.dtype, device=index.device)
        index = torch.cat([index, pad], dim=1)
        tokens = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[1])])
        if probs is not None:
            probs = torch.cat([probs, probs.new_zeros(1, num_experts)])
    token_index = index.reshape(-1)
    rows = tokens.index_select(0, token_index)
    row_probs = torch.gather(probs.t(), 1, index).reshape(-1) if probs is not None else None
    return rows, row_probs, token_index


def unpermute(rows: torch.Tensor, token_index: torch.Tensor, num_tokens: int,
              row_probs: torch.Tensor | None = None, pad_row: bool = False) -> torch.Tensor:
    """[num_tokens, h]: each token's rows summed, each times its weight (``row_probs``). The sum runs in
    the promoted dtype of rows and weights (fp32 weights from ``--moe-router-dtype`` accumulate in
    fp32) and the result has the rows' dtype, as Megatron's ``unpermute``. ``pad_row``: some rows have
    token index ``num_tokens`` (padding), dropped here."""
    dtype = rows.dtype
    if row_probs is not None:
        rows = rows * row_probs.unsqueeze(-1)
    out = rows.new_zeros(num_tokens + (1 if pad_row else 0), rows.shape[-1])
    out = out.index_add(0, token_index, rows)
    if pad_row:
        out = out[:num_tokens]
    return out.to(dtype)
