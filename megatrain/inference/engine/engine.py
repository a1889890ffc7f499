"""`GenerationEngine`: continuous batching of decoder-only generation over a slot KV cache (api.Engine).

Rank 0 (the only rank in one process) runs an engine thread that loops, one step at a time:

1. registered function calls queued by :meth:`call` run (on every rank, between steps);
2. jobs asked to cancel end ("cancelled") and free their slots;
3. one decode step for every running job (its latest token fed back, all slots in one batch);
4. waiting jobs move into free slots, first come first served, and their prompts are prefilled,
   packed into forwards of up to ``prefill_tokens`` tokens (causal attention within each prompt,
   no padding);
5. rank 0 samples each job's token (from its decode row or its prompt's last logits), sends the
   events, and ends the jobs whose stop rules say so.

A step of greedy decoding only (``lookahead``, one process) chooses its tokens on the device and the
engine launches the next step from them before it reads them (:mod:`~.lookahead`): stop rules and
events run while the device computes the next token.

Jobs join and leave between steps. Under tensor parallelism (``group``: the model's tensor-parallel
process group) rank 0 broadcasts each step's :class:`~plan.StepPlan` (JSON) and the other ranks run
:meth:`GenerationEngine.follow`, which repeats exactly the same forwards until :meth:`close`; when
idle, rank 0 sends an empty plan every ``heartbeat_s`` so that the followers' broadcast never times
out. One job's failure (its sampling, its callback, its prompt's forward) ends that job with
"error"; a failing decode forward ends the jobs of that step, and the engine goes on.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megatrain.inference.engine import lookahead
from megatrain.inference.engine.api import EngineFull, GenerateJob, JobHandle, TokenEvent
from megatrain.inference.engine.plan import PlanChannel, StepPlan
from megatrain.inference.engine.prefill_graphs import accepts_logit_positions
from megatrain.inference.engine.runner import ModelRunner
from megatrain.inference.engine.sampler import Choice, JobSampler, check_job, sample_rows
from megatrain.inference.engine.scheduler import Request, Scheduler
from megatrain.inference.engine.slot_cache import CacheShape, SlotKVCache
from megatrain.models.common.attention import CrossAttention, SelfAttention
from megatrain.models.common.mla import MLASelfAttention

__all__ = ["EngineConfig", "GenerationEngine", "generate_blocking"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """The engine's limits and decode path.

    ``max_requests`` (Megatron's ``--inference-max-requests``): slots, i.e. jobs decoding at once;
    ``max_sequence_length`` (``--inference-max-seq-length``): prompt + generated tokens of one job;
    the cache holds ``max_requests x max_sequence_length`` tokens per layer, allocated up front.
    ``max_waiting``: jobs that may wait for a slot beyond those (one more: EngineFull, with
    ``retry_after_s``). ``cuda_graphs``: decode through CUDA graphs (None: on a CUDA model in one
    process; tensor-parallel CUDA graphs are allowed when asked for, not tested); ``length_bucket``:
    the smallest key-length bucket of the graphs. ``prefill_tokens``: new prompts are packed into one
    prefill forward up to this many tokens (a longer prompt runs alone). ``compile_decode``: the decode forward through
    torch.compile (also inside the graphs); ``gemv_tuning``: that compilation's Triton kernels tuned by
    coordinate descent on CUDA, a batch-1 step's matmuls as tuned reductions (``engine/decode_compile.py``).
    ``heartbeat_s``: the idle plan interval under tensor
    parallelism. ``lookahead``: greedy decode steps run one step ahead of the host (one process).
    ``capture_graphs_at_start``: record every decode graph (each batch and key-length bucket) on the
    engine thread before the first step, as a server wants: no request waits for a recording (or a
    compilation of a new shape) in the middle of a load; requests submitted meanwhile wait in the queue.
    ``compile_prefill``: the packed prefill forward through torch.compile (dynamic token count; the
    prompts of a pack attend through one block-diagonal mask). ``prefill_graphs``: packs of up to
    ``prefill_tokens`` tokens replay CUDA graphs recorded per token bucket (None: wherever the decode
    runs CUDA graphs in one process; ``engine/prefill_graphs.py``).
    """

    max_requests: int = 16
    max_sequence_length: int = 2048
    max_waiting: int = 256
    cuda_graphs: bool | None = None
    length_bucket: int = 256
    prefill_tokens: int = 2048
    compile_decode: bool = False
    gemv_tuning: bool = True
    retry_after_s: int = 1
    heartbeat_s: float = 60.0
    lookahead: bool = True
    capture_graphs_at_start: bool = False
    compile_prefill: bool = False
    prefill_graphs: bool | None = None


@dataclass
class EngineStats:
    """What the engine thread has done (read from any thread; updated by the engine thread only)."""

    decode_steps: int = 0  # decode forwards (graph replays or eager)
    decode_rows: int = 0  # rows of those forwards that held a running job
    steps_ahead: int = 0  # decode steps launched before the host read the previous one's tokens
    prefills: int = 0  # prompts prefilled
    prefill_forwards: int = 0  # packed prefill forwards
    prefill_tokens: int = 0
    prefill_s: float = 0.0  # host time in prefill forwards (a CUDA prefill is timed to its last launch)
    graphs: int = 0  # graphs recorded at start-up (decode and prefill)
    capture_s: float = 0.0  # time spent recording graphs at start-up


@dataclass
class _Call:
    name: str
    payload: dict[str, Any]
    future: Future


def _local_device_and_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    param = next(p for p in model.parameters() if p.is_floating_point())
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.device, local.dtype


class GenerationEngine:
    """The :class:`~megatrain.inference.engine.api.Engine` of decoder-only models (see the module docstring).

    ``model``: a GPT-family model (``model(tokens, position_ids=, kv_cache=)`` -> logits), put in eval
    mode; under tensor parallelism already sharded (its logits may be vocab-sharded DTensors) and
    ``group`` its tensor-parallel group: every rank builds the engine with the same config, rank 0
    serves, the others call :meth:`follow`.
    """

    def __init__(self, model: nn.Module, config: EngineConfig = EngineConfig(), *,
                 group: dist.ProcessGroup | None = None) -> None:
        model_config = model.config
        if any(isinstance(m, CrossAttention) for m in model.modules()):
            raise ValueError("the generation engine runs decoder-only models; encoder-decoder models "
                             "(T5) generate through megatrain.inference.seq2seq or a registered call")
        if not getattr(model_config, "causal_attention", True):
            raise ValueError("the generation engine needs a causal (decoder-only) model")
        if config.max_requests <= 0 or config.max_sequence_length <= 1:
            raise ValueError("max_requests must be positive and max_sequence_length at least 2")
        if config.prefill_tokens <= 0:
            raise ValueError(f"prefill_tokens must be positive, got {config.prefill_tokens}")
        if (model_config.position_embedding_type == "learned_absolute"
                and config.max_sequence_length > model_config.max_position_embeddings):
            raise ValueError(f"max_sequence_length ({config.max_sequence_length}) exceeds the model's "
                             f"--max-position-embeddings ({model_config.max_position_embeddings})")
        self.config = config
        self.max_sequence_length = config.max_sequence_length
        self.model = model.eval()
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        device, dtype = _local_device_and_dtype(model)
        self.device = device
        self.vocab_size = int(model_config.vocab_size)
        if model_config.num_query_groups % self.world:
            raise ValueError(f"{model_config.num_query_groups} query groups do not split over {self.world} ranks")
        layers = tuple(m.layer_number for m in model.modules() if isinstance(m, (SelfAttention, MLASelfAttention)))
        if getattr(model_config, "multi_latent_attention", False):  # every head has its own keys and values
            key_dim, value_dim = model_config.qk_head_dim + model_config.qk_pos_emb_head_dim, model_config.v_head_dim
        else:
            key_dim, value_dim = model_config.kv_channels, None
        shape = CacheShape(layers, model_config.num_query_groups // self.world, key_dim,
                           config.max_requests, config.max_sequence_length, value_dim)
        self.cache = SlotKVCache(shape, dtype, device,
                                 packed_attention="mask" if config.compile_prefill else "segments")
        cuda_graphs = config.cuda_graphs
        if cuda_graphs is None:
            cuda_graphs = device.type == "cuda" and group is None
        prefill_graphs = config.prefill_graphs
        if prefill_graphs is None:
            prefill_graphs = cuda_graphs and group is None and accepts_logit_positions(model)
        self.runner = ModelRunner(model, self.cache, device, cuda_graphs=cuda_graphs,
                                  length_bucket=config.length_bucket, compile_decode=config.compile_decode,
                                  gemv_tuning=config.gemv_tuning,
                                  compile_prefill=config.compile_prefill, prefill_graphs=prefill_graphs,
                                  prefill_tokens=config.prefill_tokens)
        self.channel = PlanChannel(group, device) if group is not None and self.world > 1 else None
        self.scheduler = Scheduler(config.max_requests, config.max_waiting, config.retry_after_s)
        self._functions: dict[str, Callable[[Any, dict[str, Any]], Any]] = {}
        self._calls: deque[_Call] = deque()
        self._wake = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.stats = EngineStats()
        if self.rank == 0:
            self._thread = threading.Thread(target=self._serve, name="generation-engine", daemon=True)
            self._thread.start()

    # ---- api.Engine ---------------------------------------------------------------------------------

    def submit(self, job: GenerateJob, on_event: Callable[[TokenEvent], None]) -> JobHandle:
        if self.rank != 0:
            raise RuntimeError("submit on rank 0; the other tensor-parallel ranks run follow()")
        check_job(job, self.vocab_size, self.max_sequence_length)
        request = Request(self.scheduler.new_id(), job, on_event, JobSampler(job.sampling, self.device))
        with self._wake:  # never after the engine thread's last look at the queue
            if self._closing:
                raise RuntimeError("the engine is closed")
            self.scheduler.submit(request)
            self._wake.notify()
        return request

    def register(self, name: str, fn: Callable[[Any, dict[str, Any]], Any]) -> None:
        self._functions[name] = fn

    def call(self, name: str, payload: dict[str, Any]) -> Future:
        if self.rank != 0:
            raise RuntimeError("call on rank 0; the other tensor-parallel ranks run follow()")
        if name not in self._functions:
            raise ValueError(f"no function registered as {name!r} (known: {sorted(self._functions)})")
        try:
            payload = json.loads(json.dumps(payload, allow_nan=False))  # what every rank will see
        except (TypeError, ValueError) as e:
            raise ValueError(f"call {name!r}: the payload must be plain JSON ({e})") from None
        future: Future = Future()
        with self._wake:
            if self._closing:
                raise RuntimeError("the engine is closed")
            self._calls.append(_Call(name, payload, future))
            self._wake.notify()
        return future

    def close(self) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
            self._thread = None

    # ---- the other ranks --------------------------------------------------------------------------

    def follow(self) -> None:
        """On a rank other than 0: run every step rank 0 plans until it closes."""
        if self.rank == 0 or self.channel is None:
            raise RuntimeError("follow() is for the tensor-parallel ranks other than 0")
        with torch.inference_mode():
            while True:
                plan = self.channel.receive()
                if plan.stop:
                    return
                self._execute(plan)

    # ---- the engine thread ----------------------------------------------------------------------

    @property
    def steps_ahead(self) -> int:
        """Decode steps launched before the host read the previous one's tokens."""
        return self.stats.steps_ahead

    def _capture_at_start(self) -> None:
        if not (self.config.capture_graphs_at_start and self.runner.cuda_graphs):
            return
        start = time.perf_counter()
        try:
            self.stats.graphs = self.runner.capture_all()
        except Exception:  # noqa: BLE001 - the graphs are then recorded on first use
            log.exception("recording the decode graphs at start-up failed")
        self.stats.capture_s = time.perf_counter() - start
        log.info("engine: %d graphs (decode and prefill) recorded in %.1f s", self.stats.graphs, self.stats.capture_s)

    def _serve(self) -> None:
        with torch.inference_mode():
            self._capture_at_start()
            last_sent = time.monotonic()
            inflight: lookahead.InFlight | None = None
            while True:
                with self._wake:
                    if inflight is None and not (self._closing or self._calls or self.scheduler.has_work):
                        self._wake.wait(timeout=self.config.heartbeat_s if self.channel else None)
                    closing = self._closing
                    calls = list(self._calls)
                    self._calls.clear()
                if inflight is not None:
                    ahead = None
                    if not closing and not calls and self._may_run_ahead(inflight):
                        positions, needed = lookahead.next_positions(inflight, self.runner.scratch_position)
                        ahead = self._launch(inflight.requests, inflight.tokens, positions, needed)
                        self.stats.steps_ahead += ahead is not None
                    self._read(inflight)
                    inflight = ahead
                    if inflight is not None:
                        continue
                if closing:
                    self._shut_down(calls)
                    return
                plan, decoding, admitted = self._plan(calls)
                if (self.config.lookahead and self.channel is None and decoding and not plan.calls
                        and not plan.prefills and lookahead.greedy_only(decoding)):
                    rows = lookahead.rows_of(decoding, len(plan.decode_tokens))
                    inflight = self._launch(rows, plan.decode_tokens, plan.decode_positions, plan.decode_keys)
                    continue
                if plan.empty and (self.channel is None or time.monotonic() - last_sent < self.config.heartbeat_s):
                    continue
                if self.channel is not None:
                    self.channel.send(plan)
                    last_sent = time.monotonic()
                try:
                    self._step(plan, calls, decoding, admitted)
                except Exception as e:  # noqa: BLE001 - an engine bug ends this step's jobs, not the engine
                    log.exception("engine step failed")
                    for call in calls:
                        if not call.future.done():
                            call.future.set_exception(e)
                    for request in decoding + admitted:
                        if not request.done:
                            self._end(request, _error_event(f"engine step failed: {type(e).__name__}: {e}"))

    # ---- greedy steps one ahead of the host (lookahead.py) ------------------------------------------

    def _may_run_ahead(self, step: lookahead.InFlight) -> bool:
        """Launch the next step before reading ``step``? Only while nothing but tokens changes."""
        requests = [r for r in step.requests if r is not None]
        if any(r.done or r.cancel_requested for r in requests) or len(self.scheduler.running) != len(requests):
            return False
        if self.scheduler.admission_pending():
            return False
        for r in requests:  # the in-flight token is not the job's last by length
            n = len(r.generated) + 1
            if n >= r.job.max_new_tokens or len(r.job.prompt_ids) + n >= self.max_sequence_length:
                return False
        return True

    def _launch(self, rows: list[Request | None], tokens: list[int] | torch.Tensor, positions: list[int],
                needed: int) -> lookahead.InFlight | None:
        self.stats.decode_steps += 1
        self.stats.decode_rows += sum(r is not None for r in rows)
        try:
            return lookahead.launch(self.runner, rows, tokens, positions, needed)
        except Exception as e:  # noqa: BLE001 - this step's jobs end with "error"
            log.exception("decode step failed")
            self._fail([r for r in rows if r is not None], f"decode step failed: {type(e).__name__}: {e}")
            return None

    def _read(self, step: lookahead.InFlight) -> None:
        """Take ``step``'s tokens (rows of jobs that ended meanwhile are dropped)."""
        try:
            tokens, logprobs = step.read()
        except Exception as e:  # noqa: BLE001 - this step's jobs end with "error"
            log.exception("decode step failed")
            self._fail([r for r in step.requests if r is not None], f"decode step failed: {type(e).__name__}: {e}")
            return
        for row, request in enumerate(step.requests):
            if request is not None and not request.done:
                request.sampler.observe(tokens[row])
                self._take(request, Choice(tokens[row], logprobs[row], None))

    def _fail(self, requests: list[Request], message: str) -> None:
        for request in requests:
            if not request.done:
                self._end(request, _error_event(message))

    # ---- a step -------------------------------------------------------------------------------------

    def _plan(self, calls: list[_Call]) -> tuple[StepPlan, list[Request], list[Request]]:
        for request in self.scheduler.take_cancelled_waiting():
            self._end(request, TokenEvent(-1, 0.0, finish_reason="cancelled"))
        for request in [r for r in self.scheduler.running.values() if r.cancel_requested]:
            self._end(request, TokenEvent(-1, 0.0, finish_reason="cancelled"))
        decoding = sorted(self.scheduler.running.values(), key=lambda r: r.slot)
        admitted = self.scheduler.admit()
        plan = StepPlan(calls=[(c.name, c.payload) for c in calls],
                        prefills=[(r.slot, list(r.job.prompt_ids)) for r in admitted])
        if decoding:
            plan.decode_tokens, plan.decode_positions, plan.decode_keys = self.scheduler.decode_rows(
                decoding, self.runner.scratch_position)
        return plan, decoding, admitted

    def _execute(self, plan: StepPlan) -> tuple[list[Any], torch.Tensor | BaseException | None,
                                                 list[torch.Tensor | BaseException]]:
        """The step's model work, the same on every rank: each call's result (or exception), the
        decode logits [rows, V], each prefill's last logits [V] (or the exception)."""
        results: list[Any] = []
        for name, payload in plan.calls:
            try:
                results.append(self._functions[name](self.model, payload))
            except Exception as e:  # noqa: BLE001 - the caller's future gets it
                results.append(e)
        decoded: torch.Tensor | BaseException | None = None
        if plan.decode_tokens:
            self.stats.decode_steps += 1
            self.stats.decode_rows += sum(p != self.runner.scratch_position for p in plan.decode_positions)
            try:
                decoded = self.runner.decode(plan.decode_tokens, plan.decode_positions, plan.decode_keys)
            except Exception as e:  # noqa: BLE001 - this step's jobs end with "error"
                log.exception("decode step failed")
                decoded = e
        prefilled: list[torch.Tensor | BaseException] = []
        for pack in self._packs(plan.prefills):
            self.stats.prefills += len(pack)
            self.stats.prefill_forwards += 1
            self.stats.prefill_tokens += sum(len(prompt) for _, prompt in pack)
            start = time.perf_counter()
            try:
                prefilled.extend(self.runner.prefill(pack).unbind(0))
            except Exception as e:  # noqa: BLE001 - the pack's jobs end with "error"
                log.exception("prefill failed")
                prefilled.extend([e] * len(pack))
            self.stats.prefill_s += time.perf_counter() - start
        return results, decoded, prefilled

    def _packs(self, prefills: list[tuple[int, list[int]]]) -> list[list[tuple[int, list[int]]]]:
        """Consecutive prompts grouped into forwards of at most ``prefill_tokens`` tokens."""
        packs: list[list[tuple[int, list[int]]]] = []
        size = 0
        for item in prefills:
            if not packs or size + len(item[1]) > self.config.prefill_tokens:
                packs.append([])
                size = 0
            packs[-1].append(item)
            size += len(item[1])
        return packs

    def _step(self, plan: StepPlan, calls: list[_Call], decoding: list[Request], admitted: list[Request]) -> None:
        results, decoded, prefilled = self._execute(plan)
        for call, result in zip(calls, results):
            if isinstance(result, BaseException):
                call.future.set_exception(result)
            else:
                call.future.set_result(result)
        rows: list[torch.Tensor] = []
        sampled: list[Request] = []
        if isinstance(decoded, BaseException):
            self._fail(decoding, f"decode step failed: {type(decoded).__name__}: {decoded}")
        elif decoded is not None:
            slots = [r.slot for r in decoding]
            if slots == list(range(decoded.shape[0])):
                rows.append(decoded)
            else:
                rows.append(decoded.index_select(0, torch.tensor(slots, device=decoded.device)))
            sampled.extend(decoding)
        for request, logits in zip(admitted, prefilled):
            if isinstance(logits, BaseException):
                self._end(request, _error_event(f"prefill failed: {type(logits).__name__}: {logits}"))
            else:
                rows.append(logits[None])
                sampled.append(request)
        if not sampled:
            return
        choices = sample_rows(rows[0] if len(rows) == 1 else torch.cat(rows), [r.sampler for r in sampled], [r.job.top_logprobs for r in sampled])
        for request, choice in zip(sampled, choices):
            self._take(request, choice)

    def _take(self, request: Request, choice: Choice) -> None:
        if choice.error is not None:
            self._end(request, _error_event(choice.error))
            return
        request.generated.append(choice.token)
        reason = request.finish_reason(self.max_sequence_length)
        event = TokenEvent(choice.token, choice.logprob, choice.top_logprobs, finish_reason=reason)
        if reason is not None:
            self._end(request, event)
        elif not self._deliver(request, event):
            self.scheduler.release(request)

    def _end(self, request: Request, event: TokenEvent) -> None:
        self.scheduler.release(request)
        self._deliver(request, event)

    def _deliver(self, request: Request, event: TokenEvent) -> bool:
        """Call the job's callback; one that raises ends the job (True: delivered)."""
        try:
            request.on_event(event)
            return True
        except Exception as e:  # noqa: BLE001 - a front end's bug ends its job, not the engine
            log.exception("job %d: the event callback failed", request.id)
            if event.finish_reason is None:
                try:
                    request.on_event(_error_event(f"event callback failed: {type(e).__name__}: {e}"))
                except Exception:  # noqa: BLE001 - nothing more to tell it
                    pass
            return False

    def _shut_down(self, calls: list[_Call]) -> None:
        for call in calls:
            call.future.set_exception(RuntimeError("the engine closed before this call ran"))
        for request in list(self.scheduler.running.values()) + self.scheduler.take_all_waiting():
            self._end(request, TokenEvent(-1, 0.0, finish_reason="cancelled"))
        if self.channel is not None:
            self.channel.send(StepPlan(stop=True))


def _error_event(message: str) -> TokenEvent:
    return TokenEvent(-1, 0.0, finish_reason="error", error=message)


def generate_blocking(engine: GenerationEngine, jobs: list[GenerateJob],
                      poll_s: float = 0.01) -> list[list[TokenEvent]]:
    """Run ``jobs`` through ``engine`` and wait: each job's events in order (the last has its
    finish_reason). Jobs beyond the engine's room are submitted as room frees."""
    events: list[list[TokenEvent]] = [[] for _ in jobs]
    done = [threading.Event() for _ in jobs]

    def listener(i: int) -> Callable[[TokenEvent], None]:
        def on_event(event: TokenEvent) -> None:
            events[i].append(event)
            if event.finish_reason is not None:
                done[i].set()
        return on_event

    for i, job in enumerate(jobs):
        while True:
            try:
                engine.submit(job, listener(i))
                break
            except EngineFull:
                time.sleep(poll_s)
    for flag in done:
        flag.wait()
    return events

