"""OpenAI's ``POST /v1/chat/completions``: the conversation rendered with the checkpoint's chat template,
then generated as a completion.

The template is the tokenizer's own: a ``tokenizer.json`` folder's Hugging Face chat template
(rendered in jinja2's sandbox, as transformers' ``apply_chat_template(..., add_generation_prompt=True)``
renders it: :mod:`megatrain.data.tokenizers.chat_template`), or an ``SFTTokenizer``'s Megatron prompt
format (``--sft-tokenizer-prompt-format``, :mod:`megatrain.data.tokenizers.sft`), followed by its
assistant header. A tokenizer with neither answers 400.

Fields: ``messages`` (``role`` and ``content``: a string or a list of ``{"type": "text", "text"}``
parts, and for a vision-language checkpoint ``{"type": "image_url", "image_url": {"url": "data:..."}}``
parts (:mod:`megatrain.inference.vision_requests`; each image is ``<image>\\n`` before its message's text);
``name`` allowed), ``max_tokens`` / ``max_completion_tokens``, ``logprobs`` with
``top_logprobs`` (0-20; OpenAI's chat format ``{"content": [{"token", "logprob", "bytes",
"top_logprobs"}]}``), and the sampling fields of completions (``n``, ``stop``, ``seed``,
``temperature``, ``top_p``, ``logit_bias``, penalties, ``stream``, ``stream_options``, ``user``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from megatrain.inference.openai_generation import (MAX_TOP_LOGPROBS, SAMPLING_FIELDS, Choice, ChoiceRun, ChoiceSpec,
                                                   completion_head, parse_sampling, usage)
from megatrain.inference.server_common import (Prompt, RequestError, ServerContext, check_fields, get_bool, is_int)
from megatrain.inference.vision_requests import check_image_prompt, decode_image, image_prompt_ids

CHAT_FIELDS = ("messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", *SAMPLING_FIELDS)
ROLES = ("system", "developer", "user", "assistant", "tool")
# The assistant header a prompt format renders only in front of an assistant message's text.
_GENERATION_PROMPTS = {"nemotron-nano-v2": "<SPECIAL_11>Assistant\n"}


def _content(value: Any, where: str, images: list[tuple[str, Any]] | None = None) -> str:
    """The text of a message's content; ``image_url`` parts are collected into ``images`` as ``(where,
    url)`` and stand in the text as ``<image>\\n`` each, before the text parts (LLaVA's chat template)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts, markers = [], []
        for j, part in enumerate(value):
            if isinstance(part, dict) and part.get("type") == "image_url" and images is not None:
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append((f"{where}[{j}].image_url.url", url))
                markers.append("<image>\n")
                continue
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(f"{where}[{j}] must be {{\"type\": \"text\", \"text\": \"...\"}} or "
                                   "{\"type\": \"image_url\", \"image_url\": {\"url\": \"data:...\"}}")
            parts.append(part["text"])
        return "".join(markers) + "".join(parts)
    raise RequestError(f"{where} must be a string or a list of text and image_url parts")


def parse_messages(value: Any, images: list[tuple[str, Any]] | None = None) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object with role and content")
        unknown = set(m) - {"role", "content", "name"}
        if unknown:
            raise RequestError(f"{where} has the field {sorted(unknown)[0]!r}; a message takes role, content, name")
        if m.get("role") not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}")
        if "content" not in m:
            raise RequestError(f"{where}.content is required")
        message = {"role": m["role"], "content": _content(m["content"], f"{where}.content", images)}
        if "name" in m:
            if not isinstance(m["name"], str):
                raise RequestError(f"{where}.name must be a string")
            message["name"] = m["name"]
        out.append(message)
    return out


def render_conversation(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """The prompt text and ids for the assistant's next message; 400 without a chat template."""
    fmt = getattr(tokenizer, "prompt_format", None)
    try:
        if fmt is not None and fmt.render_message is not None:  # an SFTTokenizer's Megatron prompt format
            text = fmt.render(messages) + _GENERATION_PROMPTS.get(fmt.name, "")
            return text, list(tokenizer.encode(text, add_special_tokens=False))
        if getattr(tokenizer, "chat_templates", None):
            text = tokenizer.render_chat(messages, add_generation_prompt=True)
            return text, list(tokenizer.encode(text, add_special_tokens=False))
    except ValueError as e:  # ChatTemplateError: a template that refuses this conversation
        raise RequestError(f"the chat template cannot render these messages: {e}") from None
    name = getattr(tokenizer, "name", "") or type(tokenizer).__name__
    raise RequestError(f"this checkpoint has no chat template (its tokenizer is {name}); use POST /v1/completions, "
                       "or serve a tokenizer.json folder with a chat template (chat_template.jinja or "
                       "tokenizer_config.json \"chat_template\") or an SFTTokenizer")


@dataclass(frozen=True)
class ChatRequest:
    prompt: Prompt
    spec: ChoiceSpec
    max_tokens: int
    top_logprobs: int | None  # None: no logprobs
    images: tuple[dict[str, Any], ...] = ()  # the conversation's images, preprocessed and packed


def parse_chat(ctx: ServerContext, req: dict[str, Any]) -> ChatRequest:
    check_fields(req, CHAT_FIELDS, "POST /v1/chat/completions")
    if "messages" not in req:
        raise RequestError("messages is required")
    if ctx.seq2seq:
        raise RequestError("chat completions need a decoder-only model; this one is an encoder-decoder (T5)")
    image_parts: list[tuple[str, Any]] = []
    messages = parse_messages(req["messages"], image_parts)
    images = [decode_image(ctx, url, where) for where, url in image_parts]  # 400 for a text-only model
    if "max_tokens" in req and "max_completion_tokens" in req:
        raise RequestError("give max_tokens or max_completion_tokens, not both")
    name = "max_completion_tokens" if "max_completion_tokens" in req else "max_tokens"
    max_tokens = req.get(name)
    if max_tokens is not None:
        if not is_int(max_tokens) or max_tokens < 1:
            raise RequestError(f"{name} must be a positive integer")
        if max_tokens > ctx.limits.max_tokens_to_generate:
            raise RequestError(f"{name} is {max_tokens}; the limit is {ctx.limits.max_tokens_to_generate}")
    spec = parse_sampling(ctx, req)
    logprobs = get_bool(req, "logprobs", False)
    top = req.get("top_logprobs")
    if top is not None:
        if not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}")
        if not logprobs:
            raise RequestError("top_logprobs needs \"logprobs\": true")
    if spec.n > ctx.limits.max_batch_size:
        raise RequestError(f"n is {spec.n}; the limit is {ctx.limits.max_batch_size}")
    text, ids = render_conversation(ctx.tokenizer, messages)
    length = len(ids)
    if images:
        s = spec.sampling
        if s.logit_bias or s.presence_penalty or s.frequency_penalty:
            raise RequestError("logit_bias, presence_penalty and frequency_penalty are not supported with images")
        ids = image_prompt_ids(ctx, text, len(images), "the rendered conversation",
                               lambda t: ctx.tokenizer.encode(t, add_special_tokens=False))
        length = ctx.vision.expanded_length(ids)
    if max_tokens is None:  # what is left of the sequence, up to the server's limit
        room = [ctx.limits.max_tokens_to_generate]
        if getattr(ctx.engine, "max_sequence_length", None) is not None:
            room.append(ctx.engine.max_sequence_length - length)
        if ctx.max_positions is not None:
            room.append(ctx.max_positions - length + 1)
        max_tokens = max(1, min(room))
    if images:
        check_image_prompt(ctx, ids, max_tokens, "the rendered conversation")
    else:
        ctx.check_length(ids, max_tokens, "the rendered conversation")
    return ChatRequest(Prompt(text, ids), spec, max_tokens, (top or 0) if logprobs else None, tuple(images))


def _token_entry(ctx: ServerContext, token: int, logprob: float) -> dict[str, Any]:
    s = ctx.tokenizer.detokenize([token])
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(ctx: ServerContext, c: Choice, start: int, end: int, top_n: int) -> dict[str, Any]:
    content = []
    for token, logprob, top in zip(c.tokens[start:end], c.logprobs[start:end], c.top[start:end]):
        content.append({**_token_entry(ctx, token, logprob),
                        "top_logprobs": [_token_entry(ctx, i, v) for i, v in top[:top_n]]})
    return {"content": content}


async def chat_completions(ctx: ServerContext, req: dict[str, Any]) -> dict[str, Any]:
    r = parse_chat(ctx, req)
    run = ChoiceRun(ctx, [r.prompt], r.spec, r.spec.n, r.max_tokens, r.top_logprobs or 0, list(r.images))
    async for _ in run.deltas():
        pass
    choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                "logprobs": None if r.top_logprobs is None else chat_logprobs(ctx, c, 0, c.used, r.top_logprobs),
                "finish_reason": c.finish_reason} for i, c in enumerate(run.choices)]
    return {**completion_head("chatcmpl", "chat.completion", r.spec.model), "choices": choices,
            "usage": usage([r.prompt], run.choices)}


async def stream_chat(ctx: ServerContext, r: ChatRequest) -> AsyncIterator[dict[str, Any] | str]:
    """``chat.completion.chunk`` events: a role delta per choice, content deltas, a last delta with the
    ``finish_reason``, the usage chunk if asked, ``[DONE]``."""
    head = completion_head("chatcmpl", "chat.completion.chunk", r.spec.model)
    run = ChoiceRun(ctx, [r.prompt], r.spec, r.spec.n, r.max_tokens, r.top_logprobs or 0, list(r.images))
    run.start()
    try:
        reported = [0] * len(run.choices)

        def chunk(index: int, delta: dict[str, Any], end: int | None = None, finish_reason: str | None = None):
            lp = None
            if r.top_logprobs is not None and end is not None:
                lp = chat_logprobs(ctx, run.choices[index], reported[index], end, r.top_logprobs)
                reported[index] = max(reported[index], end)
            return {**head, "choices": [{"index": index, "delta": delta, "logprobs": lp,
                                         "finish_reason": finish_reason}]}

        for index in range(len(run.choices)):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for index, delta, _ in run.deltas():
            c = run.choices[index]
            if c.finish_reason is not None:
                rest = delta + c.stream.rest(c.text)
                yield chunk(index, {"content": rest} if rest else {}, c.used, c.finish_reason)
            elif delta:
                yield chunk(index, {"content": delta}, len(c.tokens))
        if r.spec.include_usage:
            yield {**head, "choices": [], "usage": usage([r.prompt], run.choices)}
        yield "[DONE]"
    finally:
        run.cancel()
