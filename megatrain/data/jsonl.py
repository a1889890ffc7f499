"""Reading jsonl files given on the command line, with errors that name the flag, file and line."""

from __future__ import annotations

from typing import Any, Iterator

from megatrain.json_input import parse_json

__all__ = ["iter_jsonl", "iter_jsonl_at", "parse_jsonl_line"]


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 ({e.reason})") from None


def _parse(line: str, where: str) -> Any:
    try:
        return parse_json(line)
    except ValueError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None


def parse_jsonl_line(raw: bytes, where: str) -> Any:
    """The object of one line read as bytes; not UTF-8 or not JSON raises ValueError naming ``where``
    (``FLAG FILE:LINE``)."""
    return _parse(_decode(raw, where), where)


def iter_jsonl_at(path: str, flag: str) -> Iterator[tuple[int, int, int, Any]]:
    """(line number, byte offset, byte length, parsed object) of every non-blank line of ``path``
    (so that a reader can come back to a line later, without holding the objects).

    A file that cannot be opened or a line that is not JSON raises ValueError naming ``flag``,
    the file and the line.
    """
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot open ({e.strerror})") from None
    with f:
        offset = 0
        for lineno, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            where = f"{flag} {path}:{lineno}"
            line = _decode(raw, where)
            if not line.strip():
                continue
            yield lineno, start, len(raw), _parse(line, where)


def iter_jsonl(path: str, flag: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) of every non-blank line of ``path`` (errors as `iter_jsonl_at`)."""
    for lineno, _, _, obj in iter_jsonl_at(path, flag):
        yield lineno, obj
