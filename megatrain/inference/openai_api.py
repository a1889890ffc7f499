"""OpenAI's ``POST /v1/completions`` (also streamed as server-sent events) and ``GET /v1/models``.

Fields: ``prompt`` (a string, a list of strings, a list of token ids or a list of such lists),
``max_tokens`` (16; 0 with ``echo`` scores the prompt only), ``temperature`` (0: greedy), ``top_p``,
``top_k``, ``n``, ``best_of`` (each prompt's ``best_of`` choices, the ``n`` with the highest mean token
log-probability returned), ``stop``, ``seed``, ``logit_bias``, ``presence_penalty``,
``frequency_penalty``, ``logprobs`` (the top-N per token, OpenAI's ``tokens`` / ``token_logprobs`` /
``top_logprobs`` / ``text_offset``), ``echo`` (the prompt in front, with ``logprobs`` its tokens' too:
the first null), ``stream``, ``stream_options.include_usage``, ``user``, ``model``. ``suffix`` and any
other field are a 400 naming it. The prompt's log-probabilities come from the registered ``score``
call (a full forward); generated tokens' from the engine (both the raw model's). ``text_offset`` counts
characters of prompt + completion (the token strings' lengths).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from megatrain.inference.model_calls import SCORE
from megatrain.inference.openai_generation import (MAX_TOP_LOGPROBS, SAMPLING_FIELDS, Choice, ChoiceRun, ChoiceSpec,
                                                   best, completion_head, parse_sampling, usage)
from megatrain.inference.server_common import (Prompt, RequestError, ServerContext, check_fields, engine_call,
                                               get_bool, is_int)

COMPLETION_FIELDS = ("prompt", "max_tokens", "echo", "logprobs", "best_of", *SAMPLING_FIELDS)
REFUSED = {"suffix": "suffix is not supported: this server only appends to the prompt (no insertion)"}


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[Prompt]
    spec: ChoiceSpec
    max_tokens: int
    echo: bool
    logprobs: int | None
    best_of: int


def parse_completion(ctx: ServerContext, req: dict[str, Any]) -> CompletionRequest:
    """Validate a completions request (before anything runs or is sent)."""
    check_fields(req, COMPLETION_FIELDS, "POST /v1/completions", REFUSED)
    if "prompt" not in req:
        raise RequestError("prompt is required")
    max_tokens = req.get("max_tokens", min(16, ctx.limits.max_tokens_to_generate))
    if max_tokens is None:
        max_tokens = min(16, ctx.limits.max_tokens_to_generate)
    if not is_int(max_tokens) or max_tokens < 0:
        raise RequestError("max_tokens must be a non-negative integer")
    if max_tokens > ctx.limits.max_tokens_to_generate:
        raise RequestError(f"max_tokens is {max_tokens}; the limit is {ctx.limits.max_tokens_to_generate}")
    spec = parse_sampling(ctx, req)
    echo = get_bool(req, "echo", False)
    logprobs = req.get("logprobs")
    if logprobs is not None and (not is_int(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise RequestError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}")
    best_of = req.get("best_of")
    best_of = spec.n if best_of is None else best_of
    if not is_int(best_of) or best_of < spec.n:
        raise RequestError(f"best_of must be an integer at least n ({spec.n})")
    if best_of > spec.n and spec.stream:
        raise RequestError("best_of greater than n cannot be streamed")
    prompts = ctx.prompts(req["prompt"], "prompt", max_tokens, allow_ids=True)
    if len(prompts) * best_of > ctx.limits.max_batch_size:
        raise RequestError(f"{len(prompts)} prompts x {best_of} choices exceed the {ctx.limits.max_batch_size} "
                           "sequences one request may generate")
    if ctx.seq2seq and (echo and logprobs is not None):
        raise RequestError("echo with logprobs scores the prompt as a continuation; an encoder-decoder model "
                           "(T5) does not continue its input")
    return CompletionRequest(prompts, spec, max_tokens, echo, logprobs, best_of)


def token_strings(ctx: ServerContext, ids: list[int]) -> list[str]:
    return [ctx.tokenizer.detokenize([t]) for t in ids]


def logprobs_block(ctx: ServerContext, ids: list[int], logprobs: list[float | None],
                   top: list[list[tuple[int, float]] | None], offset: int) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` object for ``ids``, their text starting at character ``offset``."""
    strings = token_strings(ctx, ids)
    offsets = []
    for s in strings:
        offsets.append(offset)
        offset += len(s)
    tops = [None if t is None else {ctx.tokenizer.detokenize([i]): lp for i, lp in t} for t in top]
    return {"tokens": strings, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def join_blocks(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    return b if a is None else {k: a[k] + b[k] for k in a}


async def prompt_logprobs(ctx: ServerContext, prompts: list[Prompt], top_n: int) -> list[dict[str, Any]]:
    """Each prompt's echo ``logprobs`` block (its first token's log-probability null).

    One exclusive full forward per prompt through the registered ``score`` call: decoding pauses
    meanwhile. (Wanted from the engine: prompt log-probabilities from its own prefill, e.g. a
    ``GenerateJob.prompt_logprobs`` top-N, so scoring is batched with everything else.)"""
    scored = await engine_call(ctx, SCORE, {"sequences": [p.ids for p in prompts], "top_n": max(1, top_n),
                                            "vocab_size": ctx.vocab_size})
    blocks = []
    for p, s in zip(prompts, scored):
        top = [None] + [[(int(i), float(v)) for i, v in row][:top_n] for row in (s["top"] or [])]
        blocks.append(logprobs_block(ctx, p.ids, [None, *s["logprobs"]], top, 0))
    return blocks


def _generated_block(ctx: ServerContext, c: Choice, start: int, end: int, offset: int, top_n: int) -> dict[str, Any]:
    return logprobs_block(ctx, c.tokens[start:end], c.logprobs[start:end],
                          [t[:top_n] for t in c.top[start:end]], offset)


async def completions(ctx: ServerContext, req: dict[str, Any]) -> dict[str, Any]:
    r = parse_completion(ctx, req)
    echoed = await prompt_logprobs(ctx, r.prompts, r.logprobs) if r.echo and r.logprobs is not None else None
    run = ChoiceRun(ctx, r.prompts, r.spec, r.best_of, r.max_tokens, r.logprobs or 0)
    async for _ in run.deltas():
        pass
    chosen = best(run.choices, r.best_of, r.spec.n)
    choices = []
    for index, c in enumerate(chosen):
        prefix = c.prompt.text if r.echo else ""
        block = None
        if r.logprobs is not None:
            p = index // r.spec.n
            block = join_blocks(echoed[p] if echoed is not None else None,
                                _generated_block(ctx, c, 0, c.used, len(c.prompt.text), r.logprobs))
        choices.append({"text": prefix + c.text, "index": index, "logprobs": block, "finish_reason": c.finish_reason})
    return {**completion_head("cmpl", "text_completion", r.spec.model), "choices": choices,
            "usage": usage(r.prompts, run.choices)}


async def stream_completions(ctx: ServerContext, r: CompletionRequest) -> AsyncIterator[dict[str, Any] | str]:
    """The events of a streamed request (validated by :func:`parse_completion`): text chunks per choice
    as they can be sent (they add up to the text the same request gives without streaming), each
    choice's last chunk with its ``finish_reason``, the usage chunk if asked, then ``[DONE]``."""
    head = completion_head("cmpl", "text_completion", r.spec.model)
    echoed = await prompt_logprobs(ctx, r.prompts, r.logprobs) if r.echo and r.logprobs is not None else None
    run = ChoiceRun(ctx, r.prompts, r.spec, r.spec.n, r.max_tokens, r.logprobs or 0)
    run.start()

    def chunk(index: int, text: str, block: dict[str, Any] | None, finish_reason: str | None = None):
        return {**head, "choices": [{"text": text, "index": index, "logprobs": block,
                                     "finish_reason": finish_reason}]}

    try:
        reported = [0] * len(run.choices)  # tokens whose logprobs were sent
        offsets = [len(c.prompt.text) for c in run.choices]
        if r.echo:
            for index, c in enumerate(run.choices):
                yield chunk(index, c.prompt.text, None if echoed is None else echoed[index // r.spec.n])

        def block(index: int, end: int) -> dict[str, Any] | None:
            if r.logprobs is None:
                return None
            c = run.choices[index]
            b = _generated_block(ctx, c, reported[index], end, offsets[index], r.logprobs)
            reported[index] = max(reported[index], end)
            offsets[index] += sum(len(s) for s in b["tokens"])
            return b

        async for index, delta, _ in run.deltas():
            c = run.choices[index]
            if c.finish_reason is not None:
                yield chunk(index, delta + c.stream.rest(c.text), block(index, c.used), c.finish_reason)
            elif delta:
                yield chunk(index, delta, block(index, len(c.tokens)))
        if r.spec.include_usage:
            yield {**head, "choices": [], "usage": usage(r.prompts, run.choices)}
        yield "[DONE]"
    finally:
        run.cancel()


def models(ctx: ServerContext) -> dict[str, Any]:
    """``GET /v1/models``: the one model this server serves."""
    return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": 0,
                                        "owned_by": "megatrain"}]}
