"""The engine's KV cache of fixed memory: ``max_requests`` slots of ``max_sequence_length`` tokens.

Each layer owns keys and values ``[max_requests, groups, max_sequence_length, head_dim]`` allocated
once (Megatron's ``--inference-max-requests`` / ``--inference-max-seq-length``); a request holds one
slot for its whole life. The cache plugs into :class:`~megatrain.models.common.attention.SelfAttention`
through the ``kv_cache`` argument as an :class:`AttendingKVCache`: the runner sets what the next forward
is (:meth:`SlotKVCache.begin_prefill` or :meth:`SlotKVCache.begin_decode`) and every layer's
:meth:`attend` stores its new keys/values and computes its attention.

- Prefill (new requests, no padding): each prompt's keys/values go to positions 0..s-1 of its slot.
  Prompts packed into one sequence share the forward's matmuls; attention runs per prompt through
  the plain causal SDPA (the fused kernels, no mask: ``packed_attention="segments"``, the default),
  or for all of them at once through a block-diagonal causal mask (``"mask"``: a dense [s, s] mask,
  which keeps SDPA off its fused kernels). :meth:`SlotKVCache.begin_prefill_tokens` takes the
  layout as device tensors instead (a recorded prefill graph's inputs: ``engine/prefill_graphs.py``).
- Decode (one new token for each of slots 0..rows-1): each row's key/value is written at that row's
  own position by one indexed write (no host sync, fixed shapes: CUDA-graph safe), then its query
  attends to the slot's keys 0..position (a bool mask built once per forward from the positions)
  over the first ``key_length`` positions only, so short sequences do not read the whole slot.
  Grouped queries are viewed as ``[rows, groups, heads_per_group, d]``: one SDPA call per layer that
  reads every shared key/value head once, without expanding them.

Rows of the decode batch that hold no running request (padding up to a batch bucket) write a
scratch key at position 0 of their free slot; a slot's positions are always written (prefill or
decode) before any query reads them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatrain.data.batch import block_causal_mask
from megatrain.models.common.attention import AttendingKVCache, CoreAttention


@dataclass(frozen=True)
class CacheShape:
    """What a slot cache holds: ``layer_numbers`` (the SelfAttention layer numbers), per layer
    ``groups`` key/value heads (this rank's, under tensor parallelism) of ``head_dim`` (values of
    ``value_dim``, default the same: multi-latent attention's are narrower)."""

    layer_numbers: tuple[int, ...]
    groups: int
    head_dim: int
    max_requests: int
    max_sequence_length: int
    value_dim: int | None = None


class SlotKVCache(AttendingKVCache):
    """Preallocated per-layer key/value slots; see the module docstring."""

    def __init__(self, shape: CacheShape, dtype: torch.dtype, device: torch.device,
                 packed_attention: str = "segments") -> None:
        if packed_attention not in ("segments", "mask"):
            raise ValueError(f"packed_attention must be 'segments' or 'mask', got {packed_attention!r}")
        self.packed_attention = packed_attention
        if shape.max_requests <= 0:
            raise ValueError(f"max_requests must be positive, got {shape.max_requests}")
        if shape.max_sequence_length <= 0:
            raise ValueError(f"max_sequence_length must be positive, got {shape.max_sequence_length}")
        self.shape = shape
        size = (shape.max_requests, shape.groups, shape.max_sequence_length, shape.head_dim)
        value_size = size[:3] + (shape.value_dim or shape.head_dim,)
        self.keys = {n: torch.zeros(size, dtype=dtype, device=device) for n in shape.layer_numbers}
        self.values = {n: torch.zeros(value_size, dtype=dtype, device=device) for n in shape.layer_numbers}
        self._key_positions = torch.arange(shape.max_sequence_length, device=device)
        self._mode: str | None = None
        self._segments: list[tuple[int, int]] = []
        self._rows = 0
        self._key_length = 0
        self._longest = 0
        self._positions: torch.Tensor | None = None
        self._row_index: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))

    # ---- what the next forward is ---------------------------------------------------------------

    def check_prefill(self, slots: list[int], lengths: list[int]) -> None:
        """A prefill of prompts of ``lengths`` tokens into ``slots`` fits the cache (else ValueError)."""
        assert len(slots) == len(lengths) > 0
        for slot, length in zip(slots, lengths):
            if not 0 <= slot < self.shape.max_requests:
                raise ValueError(f"slot {slot} is outside 0..{self.shape.max_requests - 1}")
            if not 0 < length <= self.shape.max_sequence_length:
                raise ValueError(f"a prompt of {length} tokens does not fit a slot of "
                                 f"{self.shape.max_sequence_length}")

    def begin_prefill(self, slots: list[int], lengths: list[int]) -> None:
        """The next forward is the prompts of ``lengths`` tokens of the requests in ``slots``, packed
        one after another into one sequence."""
        self.check_prefill(slots, lengths)
        self._mode, self._longest, self._mask = "prefill", 0, None
        ends = list(itertools.accumulate(lengths))
        self._segments = list(zip([0] + ends[:-1], ends))  # each prompt's tokens in the packed sequence
        device = self._key_positions.device
        counts = torch.tensor(lengths, device=device)
        # where each packed token's key/value goes: (its prompt's slot, its position in the prompt)
        self._row_index = torch.repeat_interleave(torch.tensor(slots, device=device), counts)
        self._positions = torch.cat([self._key_positions[:n] for n in lengths])
        if len(slots) > 1 and self.packed_attention == "mask":  # block-diagonal causal: each prompt sees itself
            prompt_of = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
            self._mask = block_causal_mask(prompt_of)[None, None]

    def begin_prefill_tokens(self, row_index: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> None:
        """The next forward is a packed prefill given by device tensors (fixed shapes: what a recorded
        prefill graph reads): token t's key/value goes to slot ``row_index[t]`` at ``positions[t]``,
        and its query sees the keys ``mask`` [1, 1, s, s] (bool) allows."""
        self._mode, self._longest, self._mask = "prefill", 0, mask
        self._segments = [(0, int(row_index.shape[0]))]
        self._row_index, self._positions = row_index, positions

    def begin_decode(self, positions_b1: torch.Tensor, key_length: int, longest: int,
                     window: tuple[int, int] | None = None) -> None:
        """The next forward is one token for each of slots 0..rows-1, at ``positions_b1`` [rows, 1]
        (device tensor, int64); queries read keys 0..key_length-1 (> every position); ``longest``
        (host) is the largest number of tokens a row had stored before this step; ``window``: the
        layers' (LEFT, RIGHT) sliding window, if any."""
        rows = positions_b1.shape[0]
        if not 0 < rows <= self.shape.max_requests:
            raise ValueError(f"{rows} decode rows do not fit {self.shape.max_requests} slots")
        if not 0 < key_length <= self.shape.max_sequence_length:
            raise ValueError(f"key_length {key_length} is outside 1..{self.shape.max_sequence_length}")
        self._mode, self._rows, self._key_length, self._longest = "decode", rows, key_length, longest
        self._positions = positions_b1[:, 0]
        self._row_index = torch.arange(rows, device=positions_b1.device)
        keys = self._key_positions[:key_length][None, :]  # [1, L]
        allowed = keys <= positions_b1  # [rows, L]: the slot's keys so far and this token's
        if window is not None:
            left, _ = window  # a decode query is the newest token: nothing to its right exists yet
            if left >= 0:
                allowed &= keys >= positions_b1 - left
        self._mask = allowed[:, None, None, :]  # [rows, 1, 1, L], broadcast over groups and heads

    def end(self) -> None:
        self._mode = None
        self._positions = self._row_index = self._mask = None

    # ---- AttendingKVCache ---------------------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._longest

    def layer_length(self, layer_number: int) -> int:
        return self._longest

    def attend(self, layer_number: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               core_attention: CoreAttention) -> torch.Tensor:
        keys, values = self.keys[layer_number], self.values[layer_number]
        if self._mode == "prefill":
            assert self._row_index is not None and self._positions is not None
            assert k.shape[0] == 1 and k.shape[2] == self._positions.shape[0], "a prefill is one packed sequence"
            # keys[slot of token t, :, position of t] = k[0, :, t] for every packed token at once
            keys[self._row_index, :, self._positions] = k[0].transpose(0, 1)
            values[self._row_index, :, self._positions] = v[0].transpose(0, 1)
            # causal over each prompt (and the window, if any: within a prompt, packed positions keep
            # their distances)
            if len(self._segments) == 1 or self._mask is not None:
                return core_attention(q, k, v, self._mask, 0)
            return torch.cat([core_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None, 0)
                              for a, b in self._segments], dim=2)
        assert self._mode == "decode", "begin_prefill or begin_decode before the forward"
        assert self._positions is not None and self._row_index is not None and self._mask is not None
        rows, heads, s, d = q.shape
        assert s == 1 and rows == self._rows, (q.shape, self._rows)
        groups = k.shape[1]
        # keys[row, :, position[row]] = k[row, :, 0] for every row at once
        keys[self._row_index, :, self._positions] = k[:, :, 0]
        values[self._row_index, :, self._positions] = v[:, :, 0]
        k_all = keys[:rows, :, :self._key_length]  # [rows, groups, L, d], a view
        v_all = values[:rows, :, :self._key_length]
        q_grouped = q.view(rows, groups, heads // groups, d)  # the group's heads as its "queries"
        out = F.scaled_dot_product_attention(q_grouped, k_all, v_all, attn_mask=self._mask,
                                             scale=core_attention.softmax_scale)
        return out.reshape(rows, heads, 1, v_all.shape[-1])
