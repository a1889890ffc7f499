"""Parsing JSON that users hand us (files, JSON lines, request bodies): every failure one ValueError line.

``json.loads`` fails in more ways than ``JSONDecodeError``: arrays or objects nested deeper than the
interpreter's recursion limit raise ``RecursionError``, and an integer of more than 4300 digits a
plain ``ValueError`` that points at a ``sys`` setting. :func:`parse_json` turns each failure into a
``ValueError`` whose message is a one-line reason, for the caller to prefix with the flag, file or
line it read. ``strict=True`` (for request bodies) also refuses what Python accepts but JSON does
not: ``NaN``/``Infinity``, numbers that overflow a float, and strings holding lone UTF-16 surrogates.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

__all__ = ["parse_json"]

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is too large for a 64-bit float")
    return value


def _lone_surrogate(obj: Any) -> str | None:
    """The first string (key or value) holding a lone surrogate, walked without recursion."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item
    return None


def parse_json(text: str | bytes, *, strict: bool = False) -> Any:
    """Parse one JSON document; any failure raises ``ValueError`` with a one-line reason.

    Bytes are decoded as UTF-8 (strictly). The reason carries the line and column of a syntax
    error; the caller adds where the text came from.
    """
    if isinstance(text, (bytes, bytearray, memoryview)):
        raw = bytes(text)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}: {e.reason})") from None
    extra = {"parse_constant": _refuse_constant, "parse_float": _finite_float} if strict else {}
    try:
        value = json.loads(text, **extra)
    except json.JSONDecodeError as e:
        raise ValueError(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise ValueError("arrays or objects nested too deeply to parse") from None
    except ValueError as e:
        if "integer string conversion" in str(e):
            raise ValueError("a number has more than 4300 digits") from None
        raise ValueError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if strict and _SURROGATE_ESCAPE.search(text):
        bad = _lone_surrogate(value)
        if bad is not None:
            raise ValueError(f"string {bad[:40]!r} holds a lone UTF-16 surrogate, not a character")
    return value
