"""Writing files atomically: a file appears under its final name complete, or not at all.

Everything megatrain writes for users (datasets' indices, checkpoints' metadata, exported models,
tokenizer files, generated text, docs) goes through here: the data is written to a temporary
name in the same directory, then renamed; on any error (Ctrl-C included) the temporary file is
removed and an older file under the final name is left untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any, Iterator

# The process's umask, read once at import (reading it means setting it, which is not thread-safe):
# temporary files are created private (0600) and get the mode a plain open() would give before
# they are renamed, so that files shared between users (checkpoints on a cluster) stay readable.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, fsync: bool = False) -> Iterator[str]:
    """Yield a temporary path beside ``path``; rename it to ``path`` when the body succeeds."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
    finally:
        os.close(fd)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = False) -> None:
    with atomic_path(path, fsync=fsync) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = False) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), fsync=fsync)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int = 1, sort_keys: bool = False) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")
