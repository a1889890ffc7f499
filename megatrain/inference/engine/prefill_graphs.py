"""Packed prefills at fixed shapes, recorded as CUDA graphs: one launch per prefill forward.

An eager prefill forward queues its ~1,000 operations from Python and each one hands the interpreter
lock over and takes it back; beside a busy thread (a server's event loop under many streaming
clients) every take-back waits, and a prefill ran hundreds of times slower than alone
(``benchmarks/engine_prefill.py --busy-thread``, benchmarks/RESULTS.md). Here a pack of prompts is
laid out over a fixed number of token positions (the next of ``token_buckets`` at or above its
tokens) and the forward recorded once per bucket replays with the layout as its inputs, one int64
buffer copied to the device in one transfer:

- per token: its id, its position in its prompt, its prompt's slot, its prompt's index in the pack
  (padding: -1); per prompt (up to ``max_prompts``, the rest 0): the index of its last token;
- the attention mask is built inside the graph from the prompt indices: causal within each prompt
  (block-diagonal over the pack), padding attending to padding only, so no real token sees padding;
- padding writes its keys/values at the scratch position (``max_sequence_length - 1``) of the pack's
  last prompt's slot: a position no query reads before a decode step has written it (a pack that needs
  padding and whose last prompt fills its slot to that position runs eagerly instead);
- logits only at each prompt's last token (``GPTModel.forward(logit_positions=)``), copied out of the
  graph's memory before the call returns.

The numbers are the eager ``"mask"`` prefill's (the same SDPA call, the same mask over the real tokens).
Without ``record`` (a CPU model, tests) the same fixed-shape forward runs eagerly. A forward that cannot
be recorded (one that synchronises with the host, say) raises :class:`GraphRecordError`, and the
runner goes back to eager prefills.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from megatrain.data.batch import block_causal_mask
from megatrain.inference.engine.slot_cache import SlotKVCache

__all__ = ["GraphRecordError", "StaticPrefill", "TOKEN_BUCKETS", "accepts_logit_positions"]

TOKEN_BUCKETS = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


class GraphRecordError(RuntimeError):
    """A CUDA graph (prefill here, decode in the runner) could not be recorded, e.g. because the model
    synchronises with the host inside its forward (a mixture-of-experts layer without
    ``--moe-grouped-gemm`` reads its token counts); the runner then runs those forwards eagerly."""


def accepts_logit_positions(model: nn.Module) -> bool:
    """Whether ``model.forward`` computes logits at chosen positions only (GPTModel's ``logit_positions``)."""
    try:
        return "logit_positions" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class _Shape:
    """One token bucket's buffers: the layout staged on the host (pinned on CUDA) and on the device,
    the recorded graph and its output logits [max_prompts, V]."""

    tokens: int
    staged: torch.Tensor  # [4 * tokens + max_prompts] int64
    inputs: torch.Tensor  # the same on the model's device; the forward reads it
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None  # the last copy out of ``staged`` has finished


class StaticPrefill:
    """Packed prefill forwards of ``model`` over ``cache`` at fixed token counts (module docstring)."""

    def __init__(self, model: nn.Module, cache: SlotKVCache, device: torch.device, *, max_tokens: int,
                 record: bool, pool=None, buckets: tuple[int, ...] = TOKEN_BUCKETS) -> None:
        if record and device.type != "cuda":
            raise ValueError(f"recording prefill graphs needs a CUDA model, this one is on {device}")
        self.model, self.cache, self.device, self.record = model, cache, device, record
        self.max_prompts = cache.shape.max_requests
        self.scratch_position = cache.shape.max_sequence_length - 1
        self.token_buckets = tuple(sorted({b for b in buckets if b < max_tokens} | {max_tokens}))
        self._pool = pool
        self._shapes: dict[int, _Shape] = {}

    # ---- which packs ----------------------------------------------------------------------------

    def bucket(self, tokens: int) -> int | None:
        return next((b for b in self.token_buckets if b >= tokens), None)

    def covers(self, items: list[tuple[int, list[int]]]) -> bool:
        """Whether the pack ``items`` (slot, prompt) runs here: it fits the largest bucket, and its
        padding (if any) cannot land on a position its last prompt stores."""
        total = sum(len(prompt) for _, prompt in items)
        size = self.bucket(total)
        if size is None or not 0 < len(items) <= self.max_prompts:
            return False
        return size == total or len(items[-1][1]) <= self.scratch_position

    # ---- the forward ----------------------------------------------------------------------------

    def forward(self, inputs: torch.Tensor, tokens: int) -> torch.Tensor:
        """The fixed-shape prefill of the layout ``inputs`` (module docstring) -> logits [max_prompts, V]."""
        n = tokens
        ids, positions, slots, prompt_of = inputs[:n], inputs[n:2 * n], inputs[2 * n:3 * n], inputs[3 * n:4 * n]
        ends = inputs[4 * n:]
        self.cache.begin_prefill_tokens(slots, positions, block_causal_mask(prompt_of)[None, None])
        try:
            logits = self.model(ids[None], position_ids=positions[None], kv_cache=self.cache, logit_positions=ends)
        finally:
            self.cache.end()
        from megatrain.inference.engine.runner import full_logits

        return full_logits(logits)[0]

    def _layout(self, staged: np.ndarray, items: list[tuple[int, list[int]]], n: int) -> None:
        """Fill ``staged`` (the int64 layout of one bucket of ``n`` tokens) for the pack ``items``."""
        staged[:] = 0
        ids, positions, slots, prompt_of = (staged[i * n:(i + 1) * n] for i in range(4))
        ends = staged[4 * n:]
        start = 0
        for index, (slot, prompt) in enumerate(items):
            stop = start + len(prompt)
            ids[start:stop] = prompt
            positions[start:stop] = np.arange(len(prompt))
            slots[start:stop] = slot
            prompt_of[start:stop] = index
            ends[index] = stop - 1
            start = stop
        positions[start:] = self.scratch_position
        slots[start:] = items[-1][0]
        prompt_of[start:] = -1

    def _shape(self, n: int) -> _Shape:
        if n not in self._shapes:
            size = 4 * n + self.max_prompts
            pinned = self.device.type == "cuda"
            staged = torch.zeros(size, dtype=torch.long, pin_memory=pinned)
            staged[n:2 * n] = self.scratch_position  # the recording's layout: all padding, at slot 0
            staged[3 * n:4 * n] = -1
            shape = _Shape(n, staged, staged.to(self.device))
            if self.record:
                try:
                    self._record(shape)
                except Exception as e:  # noqa: BLE001 - whatever the capture refused
                    raise GraphRecordError(f"recording the prefill graph of {n} tokens failed: "
                                            f"{type(e).__name__}: {e}") from e
            self._shapes[n] = shape
        return self._shapes[n]

    def _record(self, shape: _Shape) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation, kernel selection, the allocator
                self.forward(shape.inputs, shape.tokens)
        torch.cuda.current_stream(self.device).wait_stream(side)
        shape.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(shape.graph, pool=self._pool, capture_error_mode="thread_local"):
            shape.logits = self.forward(shape.inputs, shape.tokens)
        shape.copied = torch.cuda.Event()

    def run(self, items: list[tuple[int, list[int]]]) -> torch.Tensor:
        """The pack's logits after each prompt's last token [prompts, V] (``covers(items)`` must hold)."""
        assert self.covers(items)
        total = sum(len(prompt) for _, prompt in items)
        size = self.bucket(total)
        assert size is not None
        self.cache.check_prefill([slot for slot, _ in items], [len(prompt) for _, prompt in items])
        shape = self._shape(size)
        if shape.copied is not None:
            shape.copied.synchronize()  # (long done, in practice) the staged layout may be rewritten
        self._layout(shape.staged.numpy(), items, size)
        shape.inputs.copy_(shape.staged, non_blocking=shape.copied is not None)
        if shape.graph is None:
            return self.forward(shape.inputs, size)[:len(items)]
        assert shape.copied is not None and shape.logits is not None
        shape.copied.record()
        shape.graph.replay()
        return shape.logits[:len(items)].clone()

    def capture_all(self) -> int:
        """Record every bucket's graph now; returns how many there are."""
        for n in self.token_buckets:
            self._shape(n)
        return len(self._shapes)
