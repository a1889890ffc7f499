"""Exclusive locks on output locations, so two runs never write the same checkpoints or dataset files.

A lock is a small file (``SAVE/.megatrain.lock``, ``PREFIX.lock``) that the holder locks with
``flock`` and fills with who holds it (host, pid, command, start time). The kernel releases an
``flock`` when its process ends in any way (kill -9 included), so a lock file left behind by a
dead run is detected as stale and taken over; a live holder's details go into the one-line
error the second run prints. The holder removes the file when it releases the lock.

A process forked while holding a lock (data loader or tokenizer workers) closes its copy of the
lock's file descriptor at once: an ``flock`` lasts while any copy is open, so the orphaned workers
of a killed run would otherwise keep its lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator


class LockHeld(RuntimeError):
    """Another live process holds the lock (the message names it and the lock file)."""


@dataclass(eq=False)
class Lock:
    """A held lock: release it with `release` (or use `exclusive_lock` as a context manager)."""

    path: str
    fd: int
    stale_holder: dict[str, Any] | None = None  # what a dead holder had written, when taken over

    def release(self) -> None:
        if self.fd < 0:
            return
        _HELD.discard(self)
        with contextlib.suppress(OSError):
            # Remove the file only while it is still ours (same inode), before unlocking it.
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                os.remove(self.path)
        os.close(self.fd)
        self.fd = -1


# Locks this process holds; a forked child closes its copies of their file descriptors.
_HELD: "weakref.WeakSet[Lock]" = weakref.WeakSet()


def _forget_in_child() -> None:
    for lock in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(lock.fd)
        lock.fd = -1
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _holder_text() -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "command": " ".join(sys.argv)[:500]}) + "\n"


def _read_holder(fd: int) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError, RecursionError):
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 4096).decode("utf-8", "replace")
        holder = json.loads(data)
        if isinstance(holder, dict):
            return holder
    return None


def describe_holder(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another process (it has not written its details yet)"
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {holder.get('started', '?')}"
            + (f" ({holder['command']})" if holder.get("command") else ""))


def acquire(path: str | os.PathLike, what: str) -> Lock:
    """Take the lock file ``path`` for ``what`` (e.g. "--save /ckpt"); `LockHeld` if a live process has it.

    A lock file whose holder has died (its ``flock`` is gone) is taken over; `Lock.stale_holder`
    then says what it held.
    """
    path = os.fspath(path)
    for _ in range(20):  # retried only when the holder removed the file between our open and our lock
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OSError(e.errno, f"{what}: cannot create the lock file {path}: {os.strerror(e.errno)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LockHeld(f"{what} is in use by {describe_holder(holder)}: two runs must not write the same "
                               f"files (lock file {path}; it goes away when that run ends)") from None
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        stale = _read_holder(fd)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, _holder_text().encode("utf-8"))
        lock = Lock(path, fd, stale)
        _HELD.add(lock)
        return lock
    raise LockHeld(f"{what}: could not take the lock file {path} (it keeps being replaced)")


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, what: str) -> Iterator[Lock]:
    lock = acquire(path, what)
    try:
        yield lock
    finally:
        lock.release()
