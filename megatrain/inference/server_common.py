"""What every endpoint of the text-generation server shares: request errors, limits, field checks,
tokenized prompts, and running :class:`~megatrain.inference.engine.api.GenerateJob` s on the engine
from the event loop.

Jobs are submitted with a callback that only forwards each :class:`TokenEvent` into the request's own
``asyncio.Queue`` (``loop.call_soon_threadsafe``): the engine thread never waits for a client. A
request that ends early (its client disconnected, an error) cancels its jobs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from megatrain.inference.engine.api import Engine, EngineFull, GenerateJob, JobHandle, TokenEvent
from megatrain.json_input import parse_json

SEED_LIMIT = 1 << 63  # torch generators take 64-bit seeds


class RequestError(Exception):
    """A request the server refuses: ``status`` (4xx) and a one-line ``message``; ``headers`` added to
    the answer (``Retry-After``, ``Connection: close``)."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = " ".join(str(message).split())
        self.headers = headers or {}


@dataclass
class ServerLimits:
    max_prompt_tokens: int = 2048
    max_tokens_to_generate: int = 1024
    max_batch_size: int = 16  # prompts (times choices) per request
    max_request_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # a body not fully received in this time is answered 408
    max_pending_requests: int = 1024  # requests being answered at once; more get 503


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_request_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body; anything else raises :class:`RequestError` (400) with one line."""
    try:
        req = parse_json(raw, strict=True)
    except ValueError as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise RequestError(f"the body must be a JSON object, not {type(req).__name__}")
    return req


def check_fields(req: dict[str, Any], known: Sequence[str], endpoint: str,
                 refused: dict[str, str] | None = None) -> None:
    """400 for a field ``endpoint`` does not take (``refused``: known to others, with the reason)."""
    for name in req:
        if refused and name in refused:
            raise RequestError(refused[name])
        if name not in known:
            raise RequestError(f"{endpoint} does not take the field {name!r}; its fields: {', '.join(known)}")


def get_bool(req: dict[str, Any], name: str, default: bool, message: str | None = None) -> bool:
    value = req.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(message or f"{name} must be a boolean")
    return value


def get_number(req: dict[str, Any], name: str, default: float, low: float, high: float,
               message: str | None = None) -> float:
    value = req.get(name, default)
    if value is None:
        value = default
    if not is_number(value) or not low <= value <= high:
        raise RequestError(message or f"{name} must be a number from {low:g} to {high:g}")
    return float(value)


@dataclass(frozen=True)
class Prompt:
    """One prompt as text and as token ids (an id prompt's text is its decoding)."""

    text: str
    ids: list[int]


@dataclass
class ServerContext:
    """The engine and everything the endpoints need to turn requests into jobs."""

    engine: Engine
    tokenizer: Any
    limits: ServerLimits = field(default_factory=ServerLimits)
    model_name: str = "megatrain"
    seq2seq: bool = False  # T5: prompts are encoder inputs, generation runs through engine.call
    max_positions: int | None = None  # learned absolute positions bound prompt + output
    log_requests: bool = False  # a line per PUT /api request (Megatron's; its no_log turns it off)
    vision: Any = None  # a LLaVA model's ImagePrompts (megatrain.inference.vision); None: text only

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def eod(self) -> int | None:
        if self.seq2seq:
            from megatrain.inference.seq2seq import end_token

            return end_token(self.tokenizer)
        return getattr(self.tokenizer, "eod", None)

    def tokenize(self, text: str, where: str) -> list[int]:
        try:
            if self.seq2seq:
                from megatrain.inference.seq2seq import tokenize_with_sentinels

                return tokenize_with_sentinels(self.tokenizer, text)
            return list(self.tokenizer.tokenize(text))
        except ValueError as e:
            raise RequestError(f"{where} cannot be tokenized: {e}") from None

    def check_length(self, ids: list[int], new_tokens: int, where: str) -> None:
        """400 for a prompt over the limits, or one whose new tokens do not fit the model or the engine."""
        if not ids:
            raise RequestError(f"{where} has no tokens")
        if len(ids) > self.limits.max_prompt_tokens:
            raise RequestError(f"{where} has {len(ids)} tokens; the limit is {self.limits.max_prompt_tokens}")
        if self.seq2seq:
            if self.max_positions is not None and max(len(ids), new_tokens) > self.max_positions:
                raise RequestError(f"{where} ({len(ids)} tokens) or its {new_tokens} new tokens exceed the model's "
                                   f"{self.max_positions} positions")
            return
        if self.max_positions is not None and len(ids) + new_tokens - 1 > self.max_positions:
            raise RequestError(f"{where} ({len(ids)} tokens) plus {new_tokens} new tokens exceeds the model's "
                               f"{self.max_positions} positions")
        limit = getattr(self.engine, "max_sequence_length", None)
        if limit is not None and new_tokens > 0 and len(ids) + new_tokens > limit:
            raise RequestError(f"{where} ({len(ids)} tokens) plus {new_tokens} new tokens exceeds the server's "
                               f"{limit}-token sequence limit")

    def prompts(self, value: Any, name: str, new_tokens: int, allow_ids: bool = False) -> list[Prompt]:
        """``value`` as prompts: a string or a list of strings (and with ``allow_ids`` a list of token
        ids or a list of such lists, as OpenAI's completions take); each checked for length."""
        if isinstance(value, str):
            value = [value]
        elif allow_ids and isinstance(value, list) and value and all(is_int(t) for t in value):
            value = [value]
        if not isinstance(value, list) or not value:
            kinds = "a string, a list of strings, a list of token ids or a list of such lists" if allow_ids else \
                "a non-empty list of strings"
            raise RequestError(f"{name} must be {kinds}")
        if len(value) > self.limits.max_batch_size:
            raise RequestError(f"at most {self.limits.max_batch_size} prompts per request, got {len(value)}")
        out = []
        for i, p in enumerate(value):
            where = f"{name}[{i}]"
            if isinstance(p, str):
                if not p:
                    raise RequestError(f"{where} is empty")
                ids = self.tokenize(p, where)
                text = p
            elif allow_ids and isinstance(p, list) and all(is_int(t) for t in p):
                if not p:
                    raise RequestError(f"{where} is empty")
                bad = [t for t in p if not 0 <= t < self.vocab_size]
                if bad:
                    raise RequestError(f"{where}: token id {bad[0]} is not in 0..{self.vocab_size - 1}")
                ids = list(p)
                text = self.tokenizer.detokenize(ids)
            else:
                raise RequestError(f"{where} must be a string" + (" or a list of token ids" if allow_ids else ""))
            self.check_length(ids, new_tokens, f"prompt {i}")
            out.append(Prompt(text, ids))
        return out


@dataclass
class JobResult:
    """What one job produced: its tokens (without an error event), their log-probabilities and top-N."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None


def engine_failure(event: TokenEvent) -> RequestError | None:
    if event.finish_reason == "error":
        return RequestError(f"generation failed: {event.error}", HTTPStatus.INTERNAL_SERVER_ERROR)
    return None


class JobGroup:
    """Jobs of one request: submitted together, their events merged into one queue of
    ``(job index, event)``; :meth:`cancel` stops whatever still runs."""

    def __init__(self, ctx: ServerContext, jobs: list[GenerateJob]) -> None:
        self.ctx = ctx
        self.jobs = jobs
        self.queue: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()
        self.handles: list[JobHandle] = []
        self.open: set[int] = set()

    def start(self) -> None:
        """Submit every job; EngineFull becomes a 503 with Retry-After, ValueError a 400 (and what was
        already submitted is cancelled)."""
        loop = asyncio.get_running_loop()
        try:
            for i, job in enumerate(self.jobs):
                def on_event(event: TokenEvent, i: int = i) -> None:
                    loop.call_soon_threadsafe(self.queue.put_nowait, (i, event))

                self.open.add(i)
                self.handles.append(self.ctx.engine.submit(job, on_event))
        except EngineFull as e:
            self.cancel()
            raise RequestError(f"the server is busy: {e}", HTTPStatus.SERVICE_UNAVAILABLE,
                               {"Retry-After": str(max(1, int(e.retry_after_s)))}) from None
        except ValueError as e:
            self.cancel()
            raise RequestError(str(e)) from None

    async def events(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        """Every event until each job has finished."""
        while self.open:
            i, event = await self.queue.get()
            if event.finish_reason is not None:
                self.open.discard(i)
            yield i, event

    def cancel(self) -> None:
        for i, handle in enumerate(self.handles):
            if i in self.open:
                handle.cancel()
        self.open.clear()

    async def results(self) -> list[JobResult]:
        """Wait for every job; a job that failed in the engine makes the request a 500."""
        results = [JobResult() for _ in self.jobs]
        async for i, event in self.events():
            failure = engine_failure(event)
            if failure is not None:
                self.cancel()
                raise failure
            r = results[i]
            if event.token >= 0:  # a cancelled or failed job's last event may carry no token
                r.tokens.append(event.token)
                r.logprobs.append(event.logprob)
                r.top_logprobs.append(list(event.top_logprobs or []))
            r.finish_reason = event.finish_reason
        return results


async def run_jobs(ctx: ServerContext, jobs: list[GenerateJob]) -> list[JobResult]:
    """Run ``jobs`` to their end (cancelled if the waiting task is cancelled: a client that left)."""
    group = JobGroup(ctx, jobs)
    group.start()
    try:
        return await group.results()
    finally:
        group.cancel()


async def engine_call(ctx: ServerContext, name: str, payload: dict[str, Any]) -> Any:
    """A registered function's result (``Engine.call``); a ValueError it raised is a 400."""
    try:
        return await asyncio.wrap_future(ctx.engine.call(name, payload))
    except EngineFull as e:
        raise RequestError(f"the server is busy: {e}", HTTPStatus.SERVICE_UNAVAILABLE,
                           {"Retry-After": str(max(1, int(e.retry_after_s)))}) from None
    except ValueError as e:
        raise RequestError(str(e)) from None
