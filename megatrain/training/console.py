"""Printing from the ranks that should print: rank 0 for set-up, the last rank for training and
validation lines (it holds the loss under pipeline parallelism), one write per line."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from megatrain.parallel.distributed import get_rank, get_world_size

__all__ = ["launch_rank", "print_line", "print_rank0", "print_rank_last", "setup_logging"]


def print_line(*a: Any) -> None:
    """One write per message, so lines of several ranks sharing a stream never interleave mid-line."""
    sys.stdout.write(" ".join(str(x) for x in a) + "\n")
    sys.stdout.flush()


def launch_rank() -> int:
    """This process's rank: torch.distributed's once started, before that the launcher's RANK."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def setup_logging(level: int | None) -> int | None:
    """Megatron-LM's ``setup_logging``: ``--logging-level``, else ``MEGATRON_LOGGING_LEVEL``, sets the root
    logger's level (else it is left alone). Returns the level set."""
    if level is None:
        env = os.environ.get("MEGATRON_LOGGING_LEVEL")
        if env is not None:
            try:
                level = int(env)
            except ValueError:
                raise SystemExit(f"error: MEGATRON_LOGGING_LEVEL must be a number (like --logging-level), "
                                 f"got {env!r}") from None
    if level is not None:
        logging.getLogger().setLevel(level)
    return level


def print_rank0(*a: Any) -> None:
    """Print on rank 0 only (before torch.distributed starts, the launcher's RANK tells)."""
    if launch_rank() == 0:
        print_line(*a)


def print_rank_last(*a: Any) -> None:
    """Megatron prints training and validation lines from the last rank (it holds the loss under PP)."""
    if get_rank() == get_world_size() - 1:
        print_line(*a)
