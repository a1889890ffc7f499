"""A model's own chat template (Jinja), rendered as ``transformers``' ``apply_chat_template`` renders it.

Chat templates come with downloaded models and are untrusted: they are rendered only in
``jinja2.sandbox.ImmutableSandboxedEnvironment``, which refuses access to attributes starting with an
underscore (``''.__class__``, ``cycler.__init__.__globals__``), to mutating methods of lists and
dicts, and to ranges above 100,000 items. A template that tries is refused with one
:class:`ValueError` line (:class:`ChatTemplateError`); nothing of it runs outside the sandbox.

The environment is the one transformers gives templates, so that the same template renders the same
text: ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension (``break``/``continue``),
a ``{% generation %}...{% endgeneration %}`` tag marking the assistant's text, the ``tojson`` filter
without HTML escaping, and the globals ``raise_exception(message)``, ``strftime_now(format)``,
``dict`` and a ``namespace`` that refuses underscore names. The template sees ``messages``,
``add_generation_prompt``, ``tools``, ``documents``, the tokenizer's named special tokens
(``bos_token``, ``eos_token``, ...) and any extra keyword arguments (``enable_thinking``, ...).

:func:`assistant_spans` finds the characters of the rendered text that the assistant wrote, for a
loss on the assistant's turns only: the ``{% generation %}`` blocks when the template has them,
else, for every assistant message, the text between the conversation before it rendered with the
generation prompt and the conversation up to it rendered without.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ChatTemplateError", "ChatTemplateRefused", "compile_chat_template", "render_chat", "render_chat_with_spans",
           "assistant_spans", "plain_messages"]


class ChatTemplateError(ValueError):
    """A chat template that cannot be compiled or rendered, or that the sandbox refused (one line)."""


class ChatTemplateRefused(ChatTemplateError):
    """A chat template that tried what the sandbox forbids (Python internals, huge ranges)."""


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


# The generation spans of the render in progress in this thread or task: (pieces so far, spans).
_TRACKING: contextvars.ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = contextvars.ContextVar(
    "megatrain_chat_generation_spans", default=None)


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.utils
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 is a dependency
        raise ChatTemplateError("chat templates need jinja2 (pip install 'jinja2>=3.1.6')") from None

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}body{% endgeneration %}``: renders the body and, while spans are being
        tracked, records where in the output it went."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark", []), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            text = caller()
            tracking = _TRACKING.get()
            if tracking is not None:
                pieces, spans = tracking
                start = sum(len(p) for p in pieces)
                spans.append((start, start + len(text)))
            return text

    class SafeNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` whose attributes cannot start with an underscore (no ``ns.__dict__``)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # the signature of jinja's Namespace
            self, rest = args[0], args[1:]
            values = dict(*rest, **kwargs)
            for key in values:
                SafeNamespace._check(key)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, key: Any, value: Any) -> None:
            SafeNamespace._check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key: Any) -> None:
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {key!r} starts with an underscore")

    class PlainDict:
        """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without handing them the type itself."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any) -> dict:
            return dict.fromkeys(*args)

    def raise_exception(message: Any) -> None:
        raise jinja2.exceptions.TemplateError(str(message))

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=PlainDict(),
                       namespace=SafeNamespace)
    return env


@functools.lru_cache(maxsize=32)
def _compiled(source: str) -> Any:
    return _environment().from_string(source)


def compile_chat_template(source: Any, where: str = "the chat template") -> Any:
    """The compiled template; a syntax error raises :class:`ChatTemplateError` naming ``where`` and the line."""
    _environment()  # jinja2 is there (one clear line if not)
    import jinja2

    if not isinstance(source, str) or not source.strip():
        raise ChatTemplateError(f"{where}: the chat template must be a non-empty string")
    try:
        return _compiled(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{where}: chat template syntax error at line {e.lineno}: {_one_line(e.message)}") \
            from None
    except (jinja2.TemplateError, RecursionError, MemoryError) as e:
        raise ChatTemplateError(f"{where}: the chat template cannot be compiled: {_one_line(e)}") from None


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _plain(value: Any, depth: int = 0) -> Any:
    """JSON-like data only (str, int, float, bool, None, lists, string-keyed dicts): nothing with methods
    the sandbox does not know about reaches a template."""
    if depth > 64:
        raise ChatTemplateError("chat messages are nested too deeply")
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {str(_plain(k, depth + 1)): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    return f"<{type(value).__name__}>"


def plain_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The messages as transformers hands them to a template: plain dicts, keys whose value is None
    dropped, a message's reasoning also under ``reasoning_content`` and ``thinking``."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("a chat is a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"message {i} must be an object with \"role\" and \"content\"")
        m = {k: v for k, v in _plain(m).items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_KEYS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _render(source: str, messages: Sequence[Any], add_generation_prompt: bool, special_tokens: Mapping[str, str],
            tools: Any, documents: Any, kwargs: Mapping[str, Any], where: str,
            spans: list[tuple[int, int]] | None) -> str:
    import jinja2

    template = compile_chat_template(source, where)
    variables = {**{k: v for k, v in special_tokens.items() if v is not None}, **_plain(dict(kwargs))}
    variables.update(messages=plain_messages(messages), tools=_plain(tools), documents=_plain(documents),
                     add_generation_prompt=bool(add_generation_prompt))
    pieces: list[str] = []
    token = _TRACKING.set((pieces, spans if spans is not None else []))
    try:
        for piece in template.generate(**variables):
            pieces.append(piece)
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateRefused(f"{where}: the chat template was refused: it tried to reach Python internals, "
                                f"which the sandbox does not allow ({_one_line(e)})") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"{where}: the chat template failed on this conversation: {_one_line(e)}") from None
    except OverflowError as e:
        raise ChatTemplateRefused(f"{where}: the chat template was refused: {_one_line(e)}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError, RecursionError) as e:
        raise ChatTemplateError(f"{where}: the chat template failed on this conversation: "
                                f"{type(e).__name__}: {_one_line(e)}") from None
    finally:
        _TRACKING.reset(token)
    return "".join(pieces)


def render_chat(source: str, messages: Sequence[Any], *, add_generation_prompt: bool = False,
                special_tokens: Mapping[str, str] | None = None, tools: Any = None, documents: Any = None,
                where: str = "the chat template", **kwargs: Any) -> str:
    """The text of ``messages`` under the template ``source`` (transformers' ``apply_chat_template(...,
    tokenize=False)``)."""
    return _render(source, messages, add_generation_prompt, special_tokens or {}, tools, documents, kwargs, where,
                   None)


def render_chat_with_spans(source: str, messages: Sequence[Any], *, add_generation_prompt: bool = False,
                           special_tokens: Mapping[str, str] | None = None, tools: Any = None,
                           documents: Any = None, where: str = "the chat template",
                           **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
    """:func:`render_chat` and the character spans of its ``{% generation %}`` blocks."""
    spans: list[tuple[int, int]] = []
    text = _render(source, messages, add_generation_prompt, special_tokens or {}, tools, documents, kwargs, where,
                   spans)
    return text, spans


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def assistant_spans(source: str, messages: Sequence[Any], *, special_tokens: Mapping[str, str] | None = None,
                    where: str = "the chat template", **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation (no generation prompt) and the character spans the assistant wrote.

    With ``{% generation %}`` blocks, their spans. Otherwise each assistant message's span is what
    rendering the conversation up to it adds to the conversation before it rendered with the
    generation prompt: its content and the template's end of turn (``<|eot_id|>``, ``<|im_end|>\\n``),
    what the model has to generate. A template that renders an earlier part of the conversation
    differently once later messages follow (Qwen3's drops the reasoning block of earlier turns): the
    turn's text where it is found in the whole conversation, else its content and the end of turn
    after it; a message found neither way is refused.
    """
    special_tokens = special_tokens or {}
    if _GENERATION_TAG.search(source):
        return render_chat_with_spans(source, messages, special_tokens=special_tokens, where=where, **kwargs)
    text = render_chat(source, messages, special_tokens=special_tokens, where=where, **kwargs)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") != "assistant":
            continue
        before = (render_chat(source, messages[:i], add_generation_prompt=True, special_tokens=special_tokens,
                              where=where, **kwargs) if i else "")
        upto = render_chat(source, messages[:i + 1], special_tokens=special_tokens, where=where, **kwargs)
        if upto.startswith(before) and text.startswith(upto):
            start, end = len(before), len(upto)
        else:
            turn = upto[len(before):] if upto.startswith(before) else ""
            found = text.find(turn, cursor) if turn else -1
            content = m.get("content")
            if found < 0 and isinstance(content, str) and content and turn.count(content) == 1:
                # The turn is written differently inside the whole conversation (no reasoning block):
                # its content there, and the end of turn that follows it.
                tail = turn[turn.index(content) + len(content):]
                at = text.find(content + tail, cursor)
                if at >= 0:
                    found, turn = at, content + tail
            if found < 0:
                raise ChatTemplateError(
                    f"{where}: cannot tell which tokens assistant message {i} is: the template renders the "
                    "conversation before it differently once it follows (add {% generation %} blocks around "
                    "the assistant's text in the template)")
            start, end = found, found + len(turn)
        if end > start:
            spans.append((start, end))
        cursor = max(cursor, end)
    return text, spans
