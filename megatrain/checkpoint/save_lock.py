"""The lock on a ``--save`` directory: one run (or tool) at a time writes checkpoints there.

Rank 0 takes ``SAVE/.megatrain.lock`` (`megatrain.locking`) before anything is written to SAVE and
holds it until the run ends; when another live process holds it, every rank stops with the same
one-line error naming that process. A lock left by a run that was killed is taken over (with a
note). While it holds the lock the run owns the directory's temporary names, so it removes what an
interrupted run left under them: tracker files being replaced (``latest_checkpointed_iteration.txt
.XXXXXXXX.tmp``, the names `megatrain.atomic_io.atomic_path` uses) and ``iter_NNNNNNN.tmp`` /
``iter_NNNNNNN.deleting`` directories (a save or a retention deletion cut short). Nothing else in
SAVE is touched.

Processes forked while the lock is held (data loader workers) close their copy of it
(`megatrain.locking`).
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import shutil
from typing import Any

import torch.distributed as dist

from megatrain.locking import Lock, LockHeld, acquire, describe_holder

LOCK_NAME = ".megatrain.lock"
_TRACKER_TMP = re.compile(r"^latest_checkpointed_iteration\.txt\.[a-z0-9_]{8}\.tmp$")
_ITER_LEFTOVER = re.compile(r"^iter_\d{7,}\.(tmp|deleting)$")
# flock errors of file systems without lock support (Lustre mounted without -o flock, some FUSE).
_NO_LOCKS = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL}


def leftover_names(save: str) -> list[str]:
    """Names in ``save`` that only an interrupted run of ours leaves behind (see the module docstring)."""
    try:
        names = os.listdir(save)
    except OSError:
        return []
    out = []
    for name in names:
        path = os.path.join(save, name)
        if _TRACKER_TMP.match(name) and os.path.isfile(path) and not os.path.islink(path):
            out.append(name)
        elif _ITER_LEFTOVER.match(name) and os.path.isdir(path) and not os.path.islink(path):
            out.append(name)
    return sorted(out)


def remove_leftovers(save: str) -> list[str]:
    """Remove `leftover_names` of ``save``; only call it while holding its lock. Returns what was removed."""
    removed = []
    for name in leftover_names(save):
        path = os.path.join(save, name)
        try:
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _take(save: str, what: str) -> tuple[Lock | None, list[str]]:
    """Rank 0's part: (the lock or None where the file system has no locks, notes to print)."""
    try:
        os.makedirs(save, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: {what}: cannot create the directory: {e.strerror or e}") from None
    try:
        lock = acquire(os.path.join(save, LOCK_NAME), what)
    except LockHeld as e:
        raise SystemExit(f"error: {e}") from None
    except OSError as e:
        text = e.strerror or str(e)
        if "lock file" in text:  # acquire could not create the file; its message names it
            raise SystemExit(f"error: {text}") from None
        if e.errno in _NO_LOCKS:
            return None, [f"WARNING: {what}: the file system does not support locks ({text}); nothing stops "
                          f"another run from writing the same checkpoints"]
        raise SystemExit(f"error: {what}: cannot lock {os.path.join(save, LOCK_NAME)}: {text}") from None
    notes = []
    if lock.stale_holder:
        notes.append(f" note: {what}: taking over the lock of a run that ended without releasing it "
                     f"({describe_holder(lock.stale_holder)})")
    try:
        removed = remove_leftovers(save)
    except OSError as e:
        lock.release()
        raise SystemExit(f"error: {what}: cannot remove the temporary files of an interrupted run: "
                         f"{e.strerror or e}") from None
    if removed:
        notes.append(f" note: {what}: removed what an interrupted run left: {', '.join(removed)}")
    return lock, notes


def take_save_lock(save: str, what: str | None = None) -> Lock | None:
    """Lock ``save`` for this run (collective when torch.distributed is initialised).

    Rank 0 returns the held lock (None where the file system has no locks); the other ranks None.
    Every rank raises the same SystemExit when the directory is in use. The lock is released by
    `Lock.release` or at interpreter exit.
    """
    what = what or f"--save {save}"
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if multi else 0
    lock: Lock | None = None
    outcome: list[Any] = [None]
    if rank == 0:
        try:
            lock, notes = _take(save, what)
            for note in notes:
                print(note, flush=True)
        except SystemExit as e:
            outcome[0] = str(e)
    if multi:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise SystemExit(outcome[0])
    if lock is not None:
        atexit.register(lock.release)
    return lock
