"""What OpenAI's completions and chat completions share: the sampling fields, one choice's text as it
streams (stop strings, whole characters), and running a request's choices on the engine.

A choice stops at the tokenizer's end token, at a stop string's tokens (the engine's
``stop_token_sequences``) or as soon as its decoded text contains a stop string (the job is then
cancelled: a stop string need not be a token boundary). Its text is cut before the first stop string.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from megatrain.inference.engine.api import GenerateJob, Sampling
from megatrain.inference.server_common import (SEED_LIMIT, JobGroup, Prompt, RequestError, ServerContext,
                                               engine_call, engine_failure, get_number, is_int, is_number)
from megatrain.inference.text_generation import end_ids

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "n", "logit_bias", "presence_penalty",
                   "frequency_penalty", "user", "model", "stream", "stream_options")
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class ChoiceSpec:
    """How every choice of a request samples, and how many choices each prompt gets."""

    sampling: Sampling
    stop: list[str]
    n: int
    include_usage: bool
    stream: bool
    model: str


def parse_sampling(ctx: ServerContext, req: dict[str, Any]) -> ChoiceSpec:
    """The sampling fields OpenAI's two endpoints share (``temperature`` 0: greedy)."""
    temperature = get_number(req, "temperature", 1.0, 0.0, 100.0,
                             "temperature must be a number from 0 to 100")
    top_p = get_number(req, "top_p", 1.0, 0.0, 1.0, "top_p must be a number in (0, 1]")
    if top_p == 0.0:
        raise RequestError("top_p must be a number in (0, 1]")
    top_k = req.get("top_k", 0)
    if not is_int(top_k) or top_k < 0:
        raise RequestError("top_k must be a non-negative integer")
    seed = req.get("seed")
    if seed is not None and (not is_int(seed) or not -SEED_LIMIT <= seed < SEED_LIMIT):
        raise RequestError("seed must be an integer from -2**63 to 2**63-1")
    stop = req.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise RequestError("stop must be a non-empty string or a list of up to 4 non-empty strings")
    n = req.get("n", 1)
    if n is None:
        n = 1
    if not is_int(n) or n < 1:
        raise RequestError("n must be a positive integer")
    bias = req.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise RequestError("logit_bias must be an object mapping token ids (as strings) to numbers from -100 to 100")
    logit_bias: dict[int, float] = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.strip().lstrip("-").isdigit()):
            raise RequestError(f"logit_bias: key {key!r} is not a token id")
        token = int(key)
        if not 0 <= token < ctx.vocab_size:
            raise RequestError(f"logit_bias: token id {token} is not in 0..{ctx.vocab_size - 1}")
        if not is_number(value) or not -100 <= value <= 100:
            raise RequestError(f"logit_bias[{key!r}] must be a number from -100 to 100")
        logit_bias[token] = float(value)
    presence = get_number(req, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = get_number(req, "frequency_penalty", 0.0, -2.0, 2.0)
    user = req.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError("user must be a string")
    model = req.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string")
    stream = req.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean")
    options = req.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise RequestError("stream_options must be an object like {\"include_usage\": true}")
    if options is not None and not stream:
        raise RequestError("stream_options is only allowed with \"stream\": true")
    greedy = temperature == 0.0
    sampling = Sampling(greedy=greedy, temperature=1.0 if greedy else temperature, top_k=0 if greedy else top_k,
                        top_p=0.0 if greedy or top_p == 1.0 else top_p, seed=seed, logit_bias=logit_bias,
                        presence_penalty=presence, frequency_penalty=frequency)
    return ChoiceSpec(sampling, stop, n, bool((options or {}).get("include_usage", False)), stream,
                      model or ctx.model_name)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """Each choice its own reproducible generator: the request's seed plus the choice's number."""
    return None if seed is None else (seed + choice) % SEED_LIMIT


class StreamedText:
    """One choice's generated text while it streams: what has been sent, and what may be sent next."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """Take one generated token; return the text that can be sent now ("" if none)."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        text = self.tokenizer.detokenize(self.tokens)
        cuts = [text.index(s) for s in self.stops if s in text]
        if cuts:  # the completion ends before its first stop string
            self.stopped = True
            safe = text[:min(cuts)]
        else:
            safe = text.rstrip("\ufffd")  # a character whose bytes are not all generated yet
            held = max((k for s in self.stops for k in range(1, len(s)) if safe.endswith(s[:k])), default=0)
            safe = safe[:len(safe) - held]
        if not safe.startswith(self.sent):
            return ""  # decoding changed earlier text: wait for the final text
        delta, self.sent = safe[len(self.sent):], max(safe, self.sent, key=len)
        return delta

    def rest(self, final: str) -> str:
        """What is left to send of the finished choice's text."""
        return final[len(self.sent):] if final.startswith(self.sent) else ""


@dataclass
class Choice:
    """One choice as it is generated: its tokens with their log-probabilities, and its final text."""

    prompt: Prompt
    stream: StreamedText
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    used: int = 0  # tokens whose text is part of ``text`` (the end token and text after a stop are not)

    @property
    def tokens(self) -> list[int]:
        return self.stream.tokens

    def finish(self, ends: frozenset[int], reason: str) -> None:
        tokens = self.tokens
        body = tokens[:-1] if tokens and tokens[-1] in ends else tokens
        text = self.stream.tokenizer.detokenize(body) if body else ""
        stopped = len(body) < len(tokens)
        cuts = [text.index(s) for s in self.stream.stops if s in text]
        self.used = len(body)
        if cuts:
            text, stopped = text[:min(cuts)], True
            self.used = next(k for k in range(len(body) + 1)
                             if len(self.stream.tokenizer.detokenize(body[:k]) if k else "") >= len(text))
        self.text = text
        self.finish_reason = "stop" if stopped or self.stream.stopped or reason == "stop" else "length"

    def mean_logprob(self) -> float:
        return sum(self.logprobs) / max(1, len(self.logprobs))


def stop_token_sequences(ctx: ServerContext, stops: list[str]) -> list[list[int]]:
    out = []
    for s in stops:
        try:
            ids = list(ctx.tokenizer.tokenize(s))
        except ValueError:  # a text this tokenizer cannot encode: the text check alone stops at it
            continue
        if ids:
            out.append(ids)
    return out


class ChoiceRun:
    """Every choice of a request on the engine: ``count`` choices of each prompt, in order (choice
    ``i * count + j`` is prompt i's j-th); :meth:`deltas` yields ``(choice, new text, new tokens)`` as
    they come and finishes each choice."""

    def __init__(self, ctx: ServerContext, prompts: list[Prompt], spec: ChoiceSpec, count: int, max_tokens: int,
                 top_logprobs: int, images: list[dict[str, Any]] | None = None) -> None:
        self.ctx = ctx
        self.images = list(images or [])  # the (one) prompt's packed images: generated by the vision call
        self.eod = ctx.eod()
        ends = [] if ctx.seq2seq else [e for e in end_ids(ctx.tokenizer) if e != self.eod]  # a chat model's others
        self.ends = frozenset([self.eod, *ends] if self.eod is not None else ends)
        self.choices = [Choice(p, StreamedText(ctx.tokenizer, spec.stop)) for p in prompts for _ in range(count)]
        stops = stop_token_sequences(ctx, spec.stop) + [[e] for e in ends]
        self.jobs = [GenerateJob(c.prompt.ids, max_tokens, replace(spec.sampling,
                                                                    seed=choice_seed(spec.sampling.seed, k % count)),
                                 eod=self.eod, stop_token_sequences=stops, top_logprobs=top_logprobs)
                     for k, c in enumerate(self.choices)]
        self.group = JobGroup(ctx, self.jobs) if max_tokens > 0 else None
        self.started = False

    def start(self) -> None:
        """Submit the jobs now (a full engine is then a 503 before anything is streamed)."""
        if not self.started and self.group is not None and not self.ctx.seq2seq and not self.images:
            self.group.start()
        self.started = True

    def cancel(self) -> None:
        """Stop whatever still runs (the request ended early)."""
        if self.group is not None:
            self.group.cancel()

    async def deltas(self) -> AsyncIterator[tuple[int, str, int]]:
        """``(choice index, text that may be sent now, tokens consumed)``; each choice's last one after
        :meth:`Choice.finish` (its remaining text is then ``choice.stream.rest(choice.text)``)."""
        if self.group is None:
            for k, c in enumerate(self.choices):
                c.finish(self.ends, "length")
                yield k, "", 0
            return
        if self.ctx.seq2seq or self.images:
            async for item in (self._vision_deltas() if self.images else self._seq2seq_deltas()):
                yield item
            return
        self.start()
        try:
            async for k, event in self.group.events():
                failure = engine_failure(event)
                if failure is not None:
                    raise failure
                c = self.choices[k]
                if c.finish_reason is not None:
                    continue
                delta = ""
                if event.token >= 0 and not c.stream.stopped:
                    c.logprobs.append(event.logprob)
                    c.top.append(list(event.top_logprobs or []))
                    delta = c.stream.add(event.token) if event.token not in self.ends else ""
                    if event.token in self.ends:
                        c.stream.tokens.append(event.token)
                if c.stream.stopped and event.finish_reason is None:
                    self.group.handles[k].cancel()  # a stop string inside the text: no need to go on
                if event.finish_reason is not None:
                    c.finish(self.ends, event.finish_reason)
                yield k, delta, 1
        finally:
            self.group.cancel()


    async def _vision_deltas(self) -> AsyncIterator[tuple[int, str, int]]:
        """A prompt with images: its choices generated by the vision call (each alone, its own seed), then
        handed out."""
        from megatrain.inference.vision_requests import run_vision_call

        job = self.jobs[0]
        s = job.sampling
        if s.logit_bias or s.presence_penalty or s.frequency_penalty:
            raise RequestError("logit_bias, presence_penalty and frequency_penalty are not supported with images")
        out = await run_vision_call(
            self.ctx, [j.prompt_ids for j in self.jobs], [self.images] * len(self.jobs),
            [j.sampling.seed for j in self.jobs], job.max_new_tokens, greedy=s.greedy, temperature=s.temperature,
            top_k=s.top_k, top_p=s.top_p, eod=job.eod, stops=job.stop_token_sequences,
            logprobs=True, top_n=job.top_logprobs)
        async for item in self._hand_out(out):
            yield item

    async def _hand_out(self, results: list[dict[str, Any]]) -> AsyncIterator[tuple[int, str, int]]:
        """Choices generated whole (``tokens``, ``logprobs``, maybe ``top``) given out as deltas."""
        for k, (c, out) in enumerate(zip(self.choices, results)):
            top = out.get("top") or [[] for _ in out["tokens"]]
            for token, logprob, best in zip(out["tokens"], out["logprobs"], top):
                c.logprobs.append(logprob)
                c.top.append([(int(i), float(v)) for i, v in best])
                delta = c.stream.add(token) if token not in self.ends else ""
                if token in self.ends:
                    c.stream.tokens.append(token)
                if delta:
                    yield k, delta, 1
            ended = bool(out["tokens"]) and (out["tokens"][-1] in self.ends or c.stream.stopped)
            c.finish(self.ends, "stop" if ended else "length")
            yield k, "", 0

    async def _seq2seq_deltas(self) -> AsyncIterator[tuple[int, str, int]]:
        """An encoder-decoder's choices: generated together by the registered call, then handed out."""
        from megatrain.inference.model_calls import SEQ2SEQ_GENERATE
        from megatrain.inference.seq2seq import decoder_start_token

        job = self.jobs[0]
        s = job.sampling
        if s.logit_bias or s.presence_penalty or s.frequency_penalty or job.top_logprobs:
            raise RequestError("logit_bias, presence_penalty, frequency_penalty and logprobs are not supported for "
                               "an encoder-decoder model (T5)")
        results = []
        for k, job in enumerate(self.jobs):  # one call per choice: each has its own seed
            results += await engine_call(self.ctx, SEQ2SEQ_GENERATE, {
                "inputs": [job.prompt_ids], "max_new_tokens": job.max_new_tokens,
                "decoder_start": decoder_start_token(self.ctx.tokenizer), "greedy": s.greedy,
                "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "eod": job.eod,
                "stop_token_sequences": job.stop_token_sequences, "seed": job.sampling.seed,
                "vocab_size": self.ctx.vocab_size})
        async for item in self._hand_out(results):
            yield item


def completion_head(prefix: str, obj: str, model: str) -> dict[str, Any]:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": model}


def usage(prompts: list[Prompt], choices: list[Choice]) -> dict[str, int]:
    prompt_tokens = sum(len(p.ids) for p in prompts)
    completion_tokens = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def best(choices: list[Choice], best_of: int, n: int) -> list[Choice]:
    """For each prompt's ``best_of`` choices the ``n`` with the highest mean token log-probability."""
    out = []
    for start in range(0, len(choices), best_of):
        group = choices[start:start + best_of]
        out += sorted(group, key=lambda c: -c.mean_logprob())[:n] if best_of != n else group
    return out
