"""The contract between the generation engine and its front ends (the HTTP server, tools/generate.py).

A front end turns a request into :class:`GenerateJob` s (one per prompt and choice) and hands each to
:meth:`Engine.submit` with a callback; the engine thread calls it once per generated token with a
:class:`TokenEvent` (the last one carries ``finish_reason``). The callback must not block (a front
end forwards the event to its own queue: ``loop.call_soon_threadsafe(queue.put_nowait, event)``), so
a slow client never holds the engine. Work that needs the whole model for itself (scoring a text,
beam search, an encoder-decoder's generation) runs through :meth:`Engine.call`: a function registered
by name, run between decoding steps on every rank (under tensor parallelism each rank runs it on its
shard; the payload travels as JSON), its result returned on rank 0.

All token ids are the tokenizer's; log-probabilities are the model's own (log-softmax of its raw
logits, before temperature, penalties or biases), as Megatron and OpenAI-compatible servers report them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Sampling:
    """How one sequence chooses its tokens.

    ``greedy`` takes the most likely token (after ``logit_bias`` and penalties); otherwise tokens are
    sampled from the adjusted logits divided by ``temperature``, keeping the ``top_k`` most likely
    (0: all) and the smallest set reaching ``top_p`` (0: all). ``top_p_decay`` / ``top_p_bound``
    (Megatron's): after each token top_p becomes ``max(top_p * top_p_decay, top_p_bound)``.
    ``logit_bias`` adds to the named tokens' logits; ``presence_penalty`` subtracts once from every
    token already generated, ``frequency_penalty`` once per time it was generated (OpenAI's
    definitions). ``seed``: this sequence's own generator (reproducible whatever else runs beside it).
    """

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@dataclass(frozen=True)
class GenerateJob:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens.

    The sequence stops after producing ``eod`` or once its output ends with one of
    ``stop_token_sequences`` (those tokens are still reported); ``top_logprobs``: report, with each
    token, the log-probabilities of the N most likely tokens at that step (0: none).
    """

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    eod: int | None = None
    stop_token_sequences: list[list[int]] = field(default_factory=list)
    top_logprobs: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. ``finish_reason`` is None until the last event of a job: then "stop" (eod
    or a stop sequence), "length" (max_new_tokens or the cache's sequence limit), "cancelled", or
    "error" (``error`` says what; ``token`` is then -1 and not part of the output)."""

    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None


class EngineFull(Exception):
    """No room for another job now (every slot and the waiting queue are taken): answer 503 with
    ``Retry-After: retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class JobHandle(Protocol):
    def cancel(self) -> None:
        """Stop the job at the next step; its callback then gets a last event with "cancelled"."""


class Engine(Protocol):
    max_sequence_length: int  # prompt + generated tokens one job may hold

    def submit(self, job: GenerateJob, on_event: Callable[[TokenEvent], None]) -> JobHandle:
        """Queue a job (raises ValueError for a job that can never run, EngineFull when full)."""

    def register(self, name: str, fn: Callable[[Any, dict[str, Any]], Any]) -> None:
        """Make ``fn(model, payload)`` callable through :meth:`call` (on every rank)."""

    def call(self, name: str, payload: dict[str, Any]) -> Future:
        """Run a registered function between decoding steps; its result (rank 0's) on the future."""

    def close(self) -> None:
        """Finish: running jobs end with "cancelled", the engine thread (and follower ranks) stop."""
