"""Reading jsonl files given on the command line, with errors that name the flag, file and line."""

from __future__ import annotations

from typing import Any, Iterator

from megatrain.json_input import parse_json


def iter_jsonl(path: str, flag: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) of every non-blank line of ``path``.

    A file that cannot be opened or a line that is not JSON raises ValueError naming ``flag``,
    the file and the line.
    """
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot open ({e.strerror})") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{flag} {path}:{lineno}: not UTF-8 ({e.reason})") from None
            if not line.strip():
                continue
            try:
                obj = parse_json(line)
            except ValueError as e:
                raise ValueError(f"{flag} {path}:{lineno}: not valid JSON ({e})") from None
            yield lineno, obj
