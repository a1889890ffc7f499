"""Where this process stands in a save or a load: its rank and the world size (one process
without torch.distributed is rank 0 of 1), warnings printed once by rank 0, and the quiet use of
DCP on one process."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Iterator

import torch.distributed as dist

__all__ = ["dist_on", "rank", "world", "warn", "single_process_quiet", "fsync_dir"]

# One process without torch.distributed is an intended way to save (also from the async writer thread).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if dist_on() else 0


def world() -> int:
    return dist.get_world_size() if dist_on() else 1


def warn(message: str) -> None:
    if rank() == 0:
        print(f"WARNING: {message}", flush=True)


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when torch.distributed is not initialised: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*experimental.*")
        yield


def fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
