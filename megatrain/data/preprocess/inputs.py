"""Reading the input: the files of ``--input`` (paths, globs, ``.gz``), their lines in chunks for the
workers, one line's texts per ``--json-keys`` key (or the ``FILE:LINE: reason`` it is refused for),
and `iter_texts` for other tools (``train-tokenizer``) that read inputs by the same rules."""

from __future__ import annotations

import glob
import gzip
import json
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

from megatrain.data.preprocess.config import PreprocessError
from megatrain.json_input import parse_json

__all__ = ["expand_inputs", "input_format_of", "iter_texts", "parse_line"]

CHUNK_BYTES = 1 << 20  # lines are sent to workers in chunks of about this many bytes
CHUNK_LINES = 4096


def expand_inputs(pattern: str | Sequence[str], flag: str = "--input") -> list[str]:
    """Files named by a path or glob (or several), sorted, each checked to exist."""
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    files: list[str] = []
    for pat in patterns:
        if glob.has_magic(pat):
            matched = sorted(p for p in glob.glob(pat, recursive=True) if os.path.isfile(p))
            if not matched:
                raise PreprocessError(f"{flag} {pat}: the pattern matches no files")
            files.extend(matched)
        elif os.path.isfile(pat):
            files.append(pat)
        elif os.path.isdir(pat):
            raise PreprocessError(f"{flag} {pat}: is a directory; pass a file or a glob such as '{pat}/*.jsonl'")
        else:
            raise PreprocessError(f"{flag} {pat}: no such file")
    return files


def input_format_of(path: str, requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    name = path[:-3] if path.endswith(".gz") else path
    return "text" if name.endswith((".txt", ".text")) else "jsonl"


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


@dataclass
class _Chunk:
    file_index: int
    first_lineno: int  # 1-based line number in its file
    first_global_line: int  # 0-based line index over all files (for --partitions order)
    lines: list[bytes]
    nbytes: int


def _iter_chunks(files: list[str]) -> Iterator[_Chunk]:
    global_line = 0
    for fi, path in enumerate(files):
        lines: list[bytes] = []
        nbytes, first = 0, 1
        lineno = 0
        try:
            with _open_binary(path) as f:
                for line in f:
                    lineno += 1
                    lines.append(line)
                    nbytes += len(line)
                    if nbytes >= CHUNK_BYTES or len(lines) >= CHUNK_LINES:
                        yield _Chunk(fi, first, global_line, lines, nbytes)
                        global_line += len(lines)
                        first, lines, nbytes = lineno + 1, [], 0
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise PreprocessError(f"{path}: cannot read the file after line {lineno} ({e})") from None
        if lines:
            yield _Chunk(fi, first, global_line, lines, nbytes)
            global_line += len(lines)


def parse_line(raw: bytes, fmt: str, json_keys: Sequence[str], where: str) -> dict[str, list[str] | str] | str | None:
    """The texts of one input line per key, None for a blank jsonl line, or an error message
    starting with ``where`` (``FILE:LINE``)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte offset {e.start} of the line)"
    if fmt == "text":
        if line.endswith("\n"):
            line = line[:-1]
            if line.endswith("\r"):
                line = line[:-1]
        return {key: line for key in json_keys}
    if not line.strip():
        return None
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        return f"{where}: invalid JSON ({e.msg} at column {e.colno})"
    except (RecursionError, ValueError):  # nested too deep, an integer of thousands of digits
        try:
            parse_json(line)
        except ValueError as e:
            return f"{where}: invalid JSON ({e})"
        return f"{where}: invalid JSON"
    if not isinstance(data, dict):
        return f"{where}: expected a JSON object, got {type(data).__name__}"
    out = {}
    for key in json_keys:
        if key not in data:
            present = ", ".join(list(data)[:10]) or "none"
            return f"{where}: missing JSON key {key!r} (keys on this line: {present}; see --json-keys)"
        value = data[key]
        if isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(s, str) for s in value)
        ):
            out[key] = value
        else:
            return f"{where}: JSON key {key!r} holds {type(value).__name__}, expected a string or a list of strings"
    return out


def iter_texts(
    inputs: str | Sequence[str],
    json_keys: Sequence[str] = ("text",),
    skip_bad_lines: bool = False,
    input_format: str = "auto",
) -> Iterator[str]:
    """Every text of every document of the inputs, in order (same rules as preprocessing)."""
    files = expand_inputs(inputs)
    for path in files:
        fmt = input_format_of(path, input_format)
        for chunk in _iter_chunks([path]):
            for offset, raw in enumerate(chunk.lines):
                texts = parse_line(raw, fmt, json_keys, f"{path}:{chunk.first_lineno + offset}")
                if texts is None:
                    continue
                if isinstance(texts, str):
                    if skip_bad_lines:
                        continue
                    raise PreprocessError(texts)
                for key in json_keys:
                    value = texts[key]
                    if isinstance(value, list):
                        yield from value
                    else:
                        yield value
