"""The server's exclusive model work, registered on the engine (``Engine.register``) and run through
``Engine.call`` between decoding steps on every rank: prompt scoring, encoder-decoder generation,
beam search (:mod:`megatrain.inference.beam_search`) and Megatron's ``prevent_newline_after_colon``
sampling; and :class:`CallOnlyEngine`, the engine of a model that only runs such calls (T5).

Each is ``fn(model, payload) -> result`` with a JSON payload (under tensor parallelism every rank runs
it on its shard with the same payload; the model's logits are gathered, so every rank computes the
same result and the same tokens). Log-probabilities are the model's own: log-softmax of its raw
logits in float32.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from megatrain.inference.beam_search import beam_search
from megatrain.inference.engine.plan import PlanChannel, StepPlan
from megatrain.inference.generation import sample_next_tokens
from megatrain.models.common.attention import KVCache
from megatrain.inference.seq2seq import generate_seq2seq, sequence_logprobs

SCORE = "score"
SEQ2SEQ_GENERATE = "seq2seq_generate"
BEAM_SEARCH = "beam_search"
GENERATE_BANNING_NEWLINE = "generate_banning_newline_after_colon"


SCORE_BATCH_TOKENS = 16384  # padded tokens per scoring forward


def score(model: nn.Module, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """For each of ``payload["sequences"]`` (token id lists): the log-probability of every token after
    the first given those before it (``logprobs``, one fewer than the tokens) and, with ``top_n`` > 0,
    the ``top_n`` most likely ids at each of those positions among the first ``vocab_size`` ids
    (``top``: lists of ``[id, logprob]``). No cache; the sequences run as right-padded batches of up to
    ``SCORE_BATCH_TOKENS`` padded tokens (longest first): under causal attention a real position never
    sees the padding after it."""
    top_n = int(payload.get("top_n", 0))
    vocab_size = payload.get("vocab_size")
    device = next(model.parameters()).device
    sequences = [list(seq) for seq in payload["sequences"]]
    out: list[dict[str, Any] | None] = [None] * len(sequences)
    order = sorted((i for i, seq in enumerate(sequences) if len(seq) >= 2), key=lambda i: -len(sequences[i]))
    for i, seq in enumerate(sequences):
        if len(seq) < 2:
            out[i] = {"logprobs": [], "top": [] if top_n else None}
    batches: list[list[int]] = []
    for i in order:  # longest first: each batch's width is its first sequence's
        if batches and (len(batches[-1]) + 1) * (len(sequences[batches[-1][0]]) - 1) <= SCORE_BATCH_TOKENS:
            batches[-1].append(i)
        else:
            batches.append([i])
    with torch.inference_mode():
        for batch in batches:
            width = len(sequences[batch[0]]) - 1
            inputs = torch.zeros(len(batch), width, dtype=torch.long, device=device)
            for row, i in enumerate(batch):
                inputs[row, :len(sequences[i]) - 1] = torch.tensor(sequences[i][:-1], dtype=torch.long)
            logp_bsv = model(inputs).float().log_softmax(-1)
            for row, i in enumerate(batch):
                n = len(sequences[i]) - 1
                logp_sv = logp_bsv[row, :n]
                targets = torch.tensor(sequences[i][1:], dtype=torch.long, device=device)
                picked = logp_sv.gather(-1, targets[:, None])[:, 0].tolist()
                top = None
                if top_n:
                    values, ids = logp_sv[:, :vocab_size].topk(top_n, dim=-1)
                    top = [[[a, b] for a, b in zip(row_i, row_v)] for row_i, row_v in zip(ids.tolist(), values.tolist())]
                out[i] = {"logprobs": picked, "top": top}
    return out  # type: ignore[return-value]


def seq2seq_generate(model: nn.Module, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """An encoder-decoder's (T5's) outputs for ``payload["inputs"]`` (encoder token ids): its decoder's
    ``tokens`` and their ``logprobs`` given the input, generated as ``generate_seq2seq`` does."""
    inputs = payload["inputs"]
    kwargs = dict(decoder_start=int(payload["decoder_start"]), greedy=bool(payload["greedy"]),
                  temperature=float(payload["temperature"]), top_k=int(payload["top_k"]),
                  top_p=float(payload["top_p"]), eod=payload.get("eod"),
                  stop_token_sequences=payload.get("stop_token_sequences") or None, seed=payload.get("seed"),
                  vocab_size=payload.get("vocab_size"))
    if int(payload["max_new_tokens"]) == 0:
        return [{"tokens": [], "logprobs": []} for _ in inputs]
    with torch.no_grad():
        generated = generate_seq2seq(model, inputs, int(payload["max_new_tokens"]), **kwargs)
        return [{"tokens": new, "logprobs": sequence_logprobs(model, enc, new, kwargs["decoder_start"],
                                                              payload.get("vocab_size"))}
                for enc, new in zip(inputs, generated)]


def generate_banning_newline(model: nn.Module, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Megatron's sampling with ``prevent_newline_after_colon`` (the batching engine has no rule on the
    previous token): each prompt alone with a KV cache; after a colon token the newline token's logit is
    -1e10. Sampling as Megatron's (``top_p`` shrinking by ``top_p_decay`` to ``top_p_bound`` after each
    token), prompt i's generator seeded with ``seeds[i]``; stops after ``eod`` or a stop sequence.
    Returns each prompt's ``tokens`` and their raw ``logprobs``."""
    colon, newline = payload["newline_after_colon"]
    vocab_size = int(payload["vocab_size"])
    stops = [list(s) for s in payload.get("stop_token_sequences") or [] if s]
    if payload.get("eod") is not None:
        stops.append([int(payload["eod"])])
    device = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for prompt, seed in zip(payload["prompts"], payload["seeds"]):
            n = int(payload["max_new_tokens"])
            generator = torch.Generator(device=device).manual_seed(int(seed))
            cache = KVCache(max_length=len(prompt) + n)
            tokens = torch.tensor([prompt], dtype=torch.long, device=device)
            positions = torch.arange(len(prompt), device=device)[None]
            top_p, new, logprobs = float(payload["top_p"]), [], []
            prev = prompt[-1]
            for step in range(n):
                logits = model(tokens, position_ids=positions, kv_cache=cache)[:, -1, :vocab_size].float()
                raw = logits.log_softmax(-1)
                if prev == colon:
                    logits[:, newline] = -1e10
                token = int(sample_next_tokens(logits, bool(payload["greedy"]), float(payload["temperature"]),
                                               int(payload["top_k"]), top_p, generator)[0])
                new.append(token)
                logprobs.append(float(raw[0, token]))
                if payload.get("top_p_decay", 0.0) > 0.0:
                    top_p = max(top_p * float(payload["top_p_decay"]), float(payload.get("top_p_bound", 0.0)))
                if any(new[-len(s):] == s for s in stops) or step == n - 1:
                    break
                prev = token
                tokens = torch.tensor([[token]], dtype=torch.long, device=device)
                positions = torch.tensor([[len(prompt) + step]], device=device)
            out.append({"tokens": new, "logprobs": logprobs})
    return out


def register_model_calls(engine: Any) -> None:
    """Register every function the server calls through ``engine.call`` (on every rank, before serving)."""
    engine.register(SCORE, score)
    engine.register(SEQ2SEQ_GENERATE, seq2seq_generate)
    engine.register(BEAM_SEARCH, beam_search)
    engine.register(GENERATE_BANNING_NEWLINE, generate_banning_newline)


class CallOnlyEngine:
    """The engine of a model the batching engine does not run (an encoder-decoder, T5): registered
    calls run one at a time on a worker thread; there are no KV-cache slots or decode steps, and
    :meth:`submit` refuses.

    Under tensor parallelism (``group``: the model's tensor-parallel process group, every rank builds
    the engine and registers the same calls) rank 0 runs the worker thread and broadcasts each call as
    a :class:`~megatrain.inference.engine.plan.StepPlan` (calls only, JSON payload) before it runs it;
    the other ranks run :meth:`follow`, which runs the same calls on their shards in the same order,
    until :meth:`close`. When idle, rank 0 sends an empty plan every ``heartbeat_s`` so that the
    followers' broadcast never times out. In one process (``group`` None) nothing is broadcast.
    """

    def __init__(self, model: nn.Module, max_sequence_length: int | None = None, *, group: Any = None,
                 heartbeat_s: float = 60.0) -> None:
        import queue
        import threading

        self.model = model.eval()
        self.max_sequence_length = max_sequence_length
        self.group = group
        self.world = 1
        self.rank = 0
        self.channel = None
        self.heartbeat_s = heartbeat_s
        if group is not None:
            import torch.distributed as dist

            from megatrain.inference.engine.engine import _local_device_and_dtype

            self.world = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
            if self.world > 1:
                self.channel = PlanChannel(group, _local_device_and_dtype(model)[0])
        self._functions: dict[str, Any] = {}
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.rank == 0:
            self._thread = threading.Thread(target=self._serve, name="model-calls", daemon=True)
            self._thread.start()

    def submit(self, job: Any, on_event: Any) -> Any:
        raise ValueError("this model generates through registered calls only (an encoder-decoder model)")

    def register(self, name: str, fn: Any) -> None:
        self._functions[name] = fn

    def call(self, name: str, payload: dict[str, Any]) -> Future:
        if self.rank != 0:
            raise RuntimeError("call on rank 0; the other tensor-parallel ranks run follow()")
        if name not in self._functions:
            raise ValueError(f"no function registered as {name!r} (known: {sorted(self._functions)})")
        if self.channel is not None:
            import json

            try:
                payload = json.loads(json.dumps(payload, allow_nan=False))  # what every rank will see
            except (TypeError, ValueError) as e:
                raise ValueError(f"call {name!r}: the payload must be plain JSON ({e})") from None
            if self._closed:
                raise RuntimeError("the engine is closed")
        future: Future = Future()
        self._queue.put((name, payload, future))
        return future

    def follow(self) -> None:
        """On a rank other than 0: run every call rank 0 broadcasts until it closes."""
        if self.rank == 0 or self.channel is None:
            raise RuntimeError("follow() is for the tensor-parallel ranks other than 0")
        import logging

        while True:
            plan = self.channel.receive()
            if plan.stop:
                return
            for name, payload in plan.calls:
                try:
                    self._functions[name](self.model, payload)
                except Exception:  # noqa: BLE001 - rank 0's caller gets its own copy of the error
                    logging.getLogger(__name__).debug("call %r failed on a follower", name, exc_info=True)

    def _serve(self) -> None:
        import queue

        while True:
            try:
                item = self._queue.get(timeout=self.heartbeat_s if self.channel is not None else None)
            except queue.Empty:  # idle under tensor parallelism: keep the followers' broadcast alive
                self.channel.send(StepPlan())
                continue
            if item is None:
                self._shut_down()
                return
            name, payload, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if self.channel is not None:
                    self.channel.send(StepPlan(calls=[(name, payload)]))
                future.set_result(self._functions[name](self.model, payload))
            except BaseException as e:  # noqa: BLE001 - the caller gets it
                future.set_exception(e)

    def _shut_down(self) -> None:
        while True:  # calls queued behind the close never run
            try:
                item = self._queue.get_nowait()
            except Exception:  # noqa: BLE001 - queue.Empty
                break
            if item is not None and item[2].set_running_or_notify_cancel():
                item[2].set_exception(RuntimeError("the engine closed before this call ran"))
        if self.channel is not None:
            self.channel.send(StepPlan(stop=True))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join()
            self._thread = None
