"""Megatron's checkpoint directory layout and finding a usable checkpoint in it.

``SAVE/latest_checkpointed_iteration.txt`` names the newest complete checkpoint,
``SAVE/iter_0000100/`` holds one. A checkpoint is complete when ``meta.json`` and DCP's
``.metadata`` are there and every rank's marker lists files present with their sizes (and, when
verified, their checksums: `megatrain.checkpoint.integrity`). `find_checkpoint` takes the
newest complete one and falls back, with a warning, past broken ones; a checkpoint named by the
user (an ``iter_`` directory, ``--ckpt-step``) that does not check out is refused. In a job rank
0 decides and every rank verifies the checksums of its share of the files.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch.distributed as dist

from megatrain.checkpoint import integrity
from megatrain.checkpoint.meta import META, format_problem, read_meta
from megatrain.checkpoint.ranks import dist_on, rank, warn, world
from megatrain.checkpoint.safe_pickle import DCP_METADATA

__all__ = ["TRACKER", "DCP_METADATA", "checkpoint_dir", "iterations_in", "checkpoint_markers",
           "checkpoint_problem", "is_complete", "find_checkpoint"]

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def checkpoint_dir(save: str, iteration: int) -> str:
    return os.path.join(save, f"iter_{iteration:07d}")


def iterations_in(save: str) -> list[int]:
    """Iterations with an ``iter_XXXXXXX`` directory in ``save``, newest first."""
    try:
        names = os.listdir(save)
    except FileNotFoundError:
        return []
    its = [int(m.group(1)) for n in names if (m := _ITER_RE.match(n)) and os.path.isdir(os.path.join(save, n))]
    return sorted(its, reverse=True)


def checkpoint_markers(ckpt: str) -> tuple[list[integrity.Marker], str | None]:
    """The checkpoint's completeness markers, checked against its files' sizes: (markers, problem or None)."""
    if not os.path.isdir(ckpt):
        return [], "no such directory"
    try:
        meta = read_meta(ckpt)
    except FileNotFoundError:
        return [], f"{META} is missing"
    except (OSError, ValueError, RecursionError) as e:
        return [], f"{META} is unreadable ({str(e).splitlines()[0][:200]})"
    if not os.path.isfile(os.path.join(ckpt, DCP_METADATA)):
        return [], f"DCP {DCP_METADATA} is missing"
    problem = format_problem(meta)
    if problem is not None:
        return [], problem
    version, world_size = meta.get("format_version", 1), meta.get("world_size", 1)
    if version < 2:
        return [], None  # written before completeness markers existed
    markers = []
    for r in range(world_size):
        try:
            marker = integrity.read_marker(ckpt, r)
        except FileNotFoundError:
            return [], f"rank {r} did not finish ({integrity.marker_name(r)} is missing)"
        except OSError as e:
            return [], f"{integrity.marker_name(r)} is unreadable ({e.strerror or e})"
        except integrity.MarkerError as e:
            return [], str(e)
        problem = integrity.size_problem(ckpt, marker)
        if problem:
            return [], problem
        if version >= 3 and marker.checksums is None:
            return [], f"{marker.name} holds no checksums (checkpoint format {version} writes them; edited or damaged)"
        markers.append(marker)
    return markers, None


def checkpoint_problem(ckpt: str, verify: bool = False) -> str | None:
    """Why ``ckpt`` cannot be loaded (missing, incomplete, truncated), or None when it is complete.

    With ``verify`` every file's content is also checked against its checksums (this reads the
    whole checkpoint; `find_checkpoint` shares that work out over the ranks).
    """
    markers, problem = checkpoint_markers(ckpt)
    if problem is None and verify:
        problem = integrity.checksum_problem(ckpt, markers)
    return problem


def is_complete(ckpt: str) -> bool:
    return checkpoint_problem(ckpt) is None


def _find(load: str, step: int | None, verify: Any = None) -> str | None:
    """`find_checkpoint` on one process; ``verify(ckpt, markers)`` returns a checksum problem or None."""

    def problem_of(ckpt: str) -> str | None:
        markers, problem = checkpoint_markers(ckpt)
        return verify(ckpt, markers) if problem is None and verify is not None else problem

    if os.path.isfile(os.path.join(load, META)) or _ITER_RE.match(os.path.basename(os.path.normpath(load))):
        problem = problem_of(load)
        if problem:
            raise SystemExit(f"error: --load {load}: the checkpoint is not usable: {problem}")
        return load
    if not os.path.isdir(load):
        if step is not None:
            raise SystemExit(f"error: --load {load}: no such directory")
        return None  # as in Megatron: `--save D --load D` starts from scratch on the first launch
    if step is not None:
        ckpt = checkpoint_dir(load, step)
        problem = problem_of(ckpt)
        if problem:
            have = [it for it in iterations_in(load) if it != step and is_complete(checkpoint_dir(load, it))]
            raise SystemExit(f"error: --ckpt-step {step}: {ckpt}: {problem}; other complete checkpoints in --load: "
                             f"{', '.join(map(str, sorted(have))) or 'none'}")
        return ckpt
    tracker = os.path.join(load, TRACKER)
    newest: int | None = None
    if os.path.isfile(tracker):
        text = open(tracker, encoding="utf-8", errors="replace").read(100).strip()
        try:
            newest = int(text)
        except ValueError:
            warn(f"--load {load}: {TRACKER} does not hold an iteration number ({text!r}); "
                 f"looking for the newest complete checkpoint")
    candidates = [it for it in iterations_in(load) if newest is None or it <= newest]
    if newest is not None and newest not in candidates:
        candidates.insert(0, newest)
    if not os.path.isfile(tracker) and not candidates:
        return None
    if not os.path.isfile(tracker):
        warn(f"--load {load}: no {TRACKER}; looking for the newest complete checkpoint")
    for it in candidates:
        ckpt = checkpoint_dir(load, it)
        problem = problem_of(ckpt)
        if problem is None:
            return ckpt
        warn(f"checkpoint {ckpt} is not usable ({problem}); falling back to an earlier one")
    raise SystemExit(f"error: --load {load}: no complete checkpoint found"
                     + (f" (iterations tried: {', '.join(map(str, candidates))})" if candidates else ""))


def _verify_share(ckpt: str, r: int, world_size: int, markers: list[integrity.Marker] | None = None) -> str | None:
    """The checksum problem among the files of the markers ``m`` with ``m % world_size == r`` (this rank's
    share: at the saving layout, the files this rank wrote and mostly reads), or None. ``markers``:
    the checkpoint's, when the caller has read them already."""
    if markers is None:
        markers, problem = checkpoint_markers(ckpt)
        if problem is not None:
            return problem
    return integrity.checksum_problem(ckpt, [m for m in markers if m.rank % world_size == r])


def find_checkpoint(load: str, step: int | None = None, *, verify: bool = True) -> str | None:
    """The directory to load from ``--load`` (a SAVE dir or an iter_ dir), or None when there is none.

    Rank 0 decides (with warnings for skipped broken checkpoints) and tells the other ranks. With
    ``verify`` (the default) the files' checksums are verified too: on one process by it, in a job
    by every rank for its share of the files, the candidate being refused when any rank finds a
    changed file.
    """
    if not dist_on() or world() == 1:
        return _find(load, step, integrity.checksum_problem if verify else None)
    me, world_size = rank(), world()

    def verify_together(ckpt: str, markers: list[integrity.Marker]) -> str | None:  # rank 0; the others wait below
        dist.broadcast_object_list([("verify", ckpt)], src=0)
        return _gather_problem(_verify_share(ckpt, me, world_size, markers))

    result: list[Any] = [None]
    if me == 0:
        try:
            result[0] = ("ok", _find(load, step, verify_together if verify else None))
        except SystemExit as e:
            result[0] = ("error", str(e))
        except BaseException as e:  # the other ranks must not wait for a decision that never comes
            dist.broadcast_object_list([("error", f"error: --load {load}: rank 0 failed: {e!r}")], src=0)
            raise
        dist.broadcast_object_list(result, src=0)
    else:
        while True:
            dist.broadcast_object_list(result, src=0)
            if result[0][0] != "verify":
                break
            _gather_problem(_verify_share(result[0][1], me, world_size))
    kind, value = result[0]
    if kind == "error":
        raise SystemExit(value)
    return value


def _gather_problem(problem: str | None) -> str | None:
    """The first rank's problem of all ranks' (every rank calls this)."""
    problems: list[Any] = [None] * world()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)
