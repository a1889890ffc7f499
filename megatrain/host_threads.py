"""How many threads a process of this node may keep busy on the host (checksums, drawing initial values):
its share of the usable cores among the node's ranks (``LOCAL_WORLD_SIZE``, as torchrun sets it), at
most 16, at least 1."""

from __future__ import annotations

import os

__all__ = ["host_threads"]


def host_threads() -> int:
    """This process's share of the cores it may run on among its node's ranks, between 1 and 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without sched_getaffinity
        cores = os.cpu_count() or 1
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(16, cores // local_ranks))
