"""The model's forwards over the slot cache: one request's prefill, one decode step for slots 0..rows-1.

Decode is eager (any device), or on CUDA a replay of a CUDA graph recorded once per (batch bucket,
key-length bucket): the rows are padded up to the next batch bucket (1, 2, 4, ..., 64 and
``max_requests``) and the keys read up to the next length bucket (``length_bucket`` doubled until
``max_sequence_length``), so a step of short sequences reads only the keys it needs and every step
has one of a few fixed shapes. A graph is recorded the first time its shapes are needed, or all of
them up front by :meth:`ModelRunner.capture_all`. ``compile_decode`` runs the decode forward through
``torch.compile`` first (fewer, fused kernels), eager or recorded into the graphs; with ``gemv_tuning`` (the
default) on CUDA a batch-1 step's matmuls become reductions over the weights tuned for bandwidth
(:mod:`megatrain.inference.engine.decode_compile`). ``compile_prefill``
runs the packed prefill forward through ``torch.compile`` with a dynamic token count (one compilation
for every pack; the cache's packed attention must then be its ``"mask"`` mode, whose shapes do not
depend on the prompts' lengths): fewer host operations per prefill, which matters most when the
host is shared with a server's threads. ``prefill_graphs`` (CUDA graphs on): a pack of prompts of up to
``prefill_tokens`` tokens replays a prefill graph recorded at the next token bucket
(:mod:`megatrain.inference.engine.prefill_graphs`): one launch instead of ~1,000 operations. The
eager prefill computes the logits of each prompt's last token only (``GPTModel``'s ``logit_positions``).

Rows without a request (padding) feed token 0 at the scratch position ``max_sequence_length - 1``:
a position that no running request has stored yet (a request holding that many tokens has
finished), so the scratch write is overwritten before any query could read it. Graph warm-up and
recording use the same scratch rows, so recording while requests are running is safe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from megatrain.inference.engine.decode_compile import decode_compile_kwargs
from megatrain.inference.engine.prefill_graphs import GraphRecordError, StaticPrefill, accepts_logit_positions
from megatrain.inference.engine.slot_cache import SlotKVCache

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits of a tensor-parallel model may be sharded on the vocabulary: gathered here."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def greedy_choice(logits_bv: torch.Tensor) -> torch.Tensor:
    """[2, rows] float64: each row's argmax token and its log-probability, from the float32 logits (the
    sampler's plain greedy choice)."""
    logits = logits_bv.float()
    chosen = logits.argmax(dim=-1)
    # the chosen token's log-softmax without the [rows, V] log-softmax itself (two reductions over the row)
    logprobs = logits.gather(1, chosen[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    return torch.stack([chosen.double(), logprobs.double()])


def buckets_up_to(limit: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """``sizes`` below ``limit``, and ``limit`` itself."""
    return tuple(sorted({s for s in sizes if s < limit} | {limit}))


@dataclass
class _DecodeGraph:
    """A recorded decode step: its inputs (row 0 tokens, row 1 positions) staged in pinned memory and
    copied to the device in one transfer, its output logits and each row's greedy choice."""

    graph: torch.cuda.CUDAGraph
    staged: torch.Tensor  # [2, batch] int64, pinned
    inputs: torch.Tensor  # [2, batch] int64 on the device; the graph reads it
    logits_bv: torch.Tensor
    greedy_2b: torch.Tensor  # [2, batch] float64: argmax token, its log-probability (greedy_choice)
    copied: torch.cuda.Event  # the last copy out of ``staged`` has finished


class ModelRunner:
    """Prefill and decode forwards of ``model`` over ``cache`` (see the module docstring)."""

    def __init__(self, model: nn.Module, cache: SlotKVCache, device: torch.device, *, cuda_graphs: bool,
                 length_bucket: int = 256, compile_decode: bool = False, compile_prefill: bool = False,
                 prefill_graphs: bool = False, prefill_tokens: int = 2048,
                 compile_mode: str | None = None, gemv_tuning: bool = True) -> None:
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA model, this one is on {device}")
        if length_bucket <= 0:
            raise ValueError(f"length_bucket must be positive, got {length_bucket}")
        self.model = model
        self.cache = cache
        self.device = device
        self.cuda_graphs = cuda_graphs
        window = getattr(model.config, "window_size", None)
        self.window = None if window is None or tuple(window) == (-1, -1) else tuple(window)
        shape = cache.shape
        self.scratch_position = shape.max_sequence_length - 1
        self.batch_buckets = buckets_up_to(shape.max_requests, BATCH_BUCKETS)
        lengths, size = [], length_bucket
        while size < shape.max_sequence_length:
            lengths.append(size)
            size *= 2
        self.length_buckets = tuple(lengths) + (shape.max_sequence_length,)
        # --compile: the decode forward through torch.compile (fused norms, rotary and mask kernels;
        # its shapes marked dynamic after the first recompile), recorded into the graphs as is;
        # ``compile_mode`` (e.g. "max-autotune-no-cudagraphs": autotuned GEMV templates) for the decode only
        self._decode_forward = (torch.compile(self._forward, **decode_compile_kwargs(device, compile_mode, gemv_tuning))
                                if compile_decode else self._forward)
        if compile_prefill and getattr(cache, "packed_attention", "mask") != "mask":
            raise ValueError("compile_prefill needs the cache's packed_attention='mask'")
        self._prefill_forward = (torch.compile(self._prefill_logits, dynamic=True) if compile_prefill
                                 else self._prefill_logits)
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self.logit_positions = accepts_logit_positions(model)  # the prefill computes only the logits it reads
        self.static_prefill: StaticPrefill | None = None
        if prefill_graphs:
            if not (cuda_graphs and self.logit_positions):
                raise ValueError("prefill_graphs needs cuda_graphs and a model whose forward takes logit_positions")
            # their own memory pool: a replay must not reuse the memory of the decode graphs' outputs
            self.static_prefill = StaticPrefill(model, cache, device, max_tokens=prefill_tokens, record=True,
                                                pool=torch.cuda.graph_pool_handle())

    # ---- prefill --------------------------------------------------------------------------------

    def prefill(self, items: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Store each (slot, prompt)'s keys/values in its slot, the prompts packed into one forward;
        return the logits after each prompt's last token [prompts, V]."""
        if self.static_prefill is not None and self.static_prefill.covers(items):
            try:
                return self.static_prefill.run(items)
            except GraphRecordError as e:
                self._prefill_eagerly(e)
        lengths = [len(prompt) for _, prompt in items]
        tokens = torch.tensor([[t for _, prompt in items for t in prompt]], dtype=torch.long, device=self.device)
        positions = torch.tensor([[p for n in lengths for p in range(n)]], dtype=torch.long, device=self.device)
        ends = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        self.cache.begin_prefill([slot for slot, _ in items], lengths)
        try:
            return self._prefill_forward(tokens, positions, ends)
        finally:
            self.cache.end()

    def _prefill_logits(self, tokens: torch.Tensor, positions: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        if self.logit_positions:
            return full_logits(self.model(tokens, position_ids=positions, kv_cache=self.cache,
                                          logit_positions=ends))[0]
        logits = self.model(tokens, position_ids=positions, kv_cache=self.cache)
        return full_logits(logits)[0].index_select(0, ends)

    # ---- decode ---------------------------------------------------------------------------------

    def decode(self, tokens: list[int] | torch.Tensor, positions: list[int], needed: int) -> torch.Tensor:
        """One token for each of slots 0..rows-1 (``tokens[i]`` at ``positions[i]``; padding rows at
        :attr:`scratch_position`); ``tokens``: host ids, or ids [rows] already on the device (a
        previous step's choice, read in stream order). ``needed``: the largest position of a real
        row + 1 (the keys that must be read). Returns the rows' logits [rows, V]."""
        return self._decode(tokens, positions, needed, False)

    def decode_greedy(self, tokens: list[int] | torch.Tensor, positions: list[int], needed: int) -> torch.Tensor:
        """:meth:`decode`'s step, returning each row's greedy choice [2, rows] (float64: token, its
        log-probability; :func:`greedy_choice`) computed in the same graph as the logits."""
        return self._decode(tokens, positions, needed, True)

    def _decode(self, tokens: list[int] | torch.Tensor, positions: list[int], needed: int,
                greedy: bool) -> torch.Tensor:
        rows = len(tokens)
        assert rows == len(positions) and rows > 0 and 0 < needed <= self.cache.shape.max_sequence_length
        if self.cuda_graphs:
            try:
                graph = self._replay(tokens, positions, needed)
                return graph.greedy_2b[:, :rows] if greedy else graph.logits_bv[:rows]
            except GraphRecordError as e:
                self._decode_eagerly(e)
        if isinstance(tokens, torch.Tensor):
            tokens_b1 = tokens.to(self.device, torch.long)[:, None]
        else:
            tokens_b1 = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        positions_b1 = torch.tensor(positions, dtype=torch.long, device=self.device)[:, None]
        logits_bv, greedy_2b = self._decode_forward(tokens_b1, positions_b1, needed, greedy)
        return greedy_2b if greedy else logits_bv

    def _forward(self, tokens_b1: torch.Tensor, positions_b1: torch.Tensor, key_length: int,
                 greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.cache.begin_decode(positions_b1, key_length, longest=key_length - 1, window=self.window)
        try:
            logits = self.model(tokens_b1, position_ids=positions_b1, kv_cache=self.cache)
        finally:
            self.cache.end()
        logits_bv = full_logits(logits)[:, -1]
        return logits_bv, greedy_choice(logits_bv) if greedy else None

    def bucket(self, rows: int, key_length: int) -> tuple[int, int]:
        """The (batch, key-length) graph shapes that cover ``rows`` rows reading ``key_length`` keys."""
        batch = next(b for b in self.batch_buckets if b >= rows)
        length = next(n for n in self.length_buckets if n >= key_length)
        return batch, length

    def _replay(self, tokens: list[int] | torch.Tensor, positions: list[int], key_length: int) -> _DecodeGraph:
        rows = len(tokens)
        graph = self._graph(*self.bucket(rows, key_length))
        graph.copied.synchronize()  # (long done, in practice: the last step's logits were read)
        staged = graph.staged.numpy()
        on_device = isinstance(tokens, torch.Tensor)
        staged[0, :rows] = 0 if on_device else tokens
        staged[1, :rows] = positions
        staged[0, rows:], staged[1, rows:] = 0, self.scratch_position
        graph.inputs.copy_(graph.staged, non_blocking=True)
        graph.copied.record()
        if on_device:
            graph.inputs[0, :rows].copy_(tokens)
        graph.graph.replay()
        return graph

    def _graph(self, batch: int, key_length: int) -> _DecodeGraph:
        key = (batch, key_length)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._record(batch, key_length)
            except Exception as e:  # noqa: BLE001 - whatever the capture refused
                raise GraphRecordError(f"recording the decode graph of batch {batch}, {key_length} keys failed: "
                                       f"{type(e).__name__}: {e}") from e
        return self._graphs[key]

    def _record(self, batch: int, key_length: int) -> _DecodeGraph:
        inputs = torch.zeros(2, batch, dtype=torch.long, device=self.device)
        inputs[1] = self.scratch_position
        tokens_b1, positions_b1 = inputs[0].view(batch, 1), inputs[1].view(batch, 1)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation, kernel selection, compilation, the allocator
                self._decode_forward(tokens_b1, positions_b1, key_length, True)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits_bv, greedy_2b = self._decode_forward(tokens_b1, positions_b1, key_length, True)
        staged = torch.empty(2, batch, dtype=torch.long, pin_memory=True)
        return _DecodeGraph(graph, staged, inputs, logits_bv, greedy_2b, torch.cuda.Event())

    def capture_all(self) -> int:
        """Record every decode graph (and prefill graph) now instead of on first use; returns how many
        there are."""
        if not self.cuda_graphs:
            raise ValueError("capture_all: this runner decodes eagerly (cuda_graphs=False)")
        try:
            for batch in self.batch_buckets:
                for length in self.length_buckets:
                    self._graph(batch, length)
        except GraphRecordError as e:
            self._decode_eagerly(e)
        prefills = 0
        if self.static_prefill is not None:
            try:
                prefills = self.static_prefill.capture_all()
            except GraphRecordError as e:
                self._prefill_eagerly(e)
        return len(self._graphs) + prefills

    def _decode_eagerly(self, error: GraphRecordError) -> None:
        """A decode graph could not be recorded: every decode step from now on runs eagerly."""
        log.warning("%s; decode steps run eagerly from now on", error)
        self.cuda_graphs = False
        self._graphs.clear()

    def _prefill_eagerly(self, error: GraphRecordError) -> None:
        """A prefill graph could not be recorded: every prefill from now on runs eagerly."""
        log.warning("%s; prefills run eagerly from now on", error)
        self.static_prefill = None
