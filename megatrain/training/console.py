"""Printing from the ranks that should print: rank 0 for set-up, the last rank for training and
validation lines (it holds the loss under pipeline parallelism), one write per line."""

from __future__ import annotations

import sys
from typing import Any

from megatrain.parallel.distributed import get_rank, get_world_size

__all__ = ["print_line", "print_rank0", "print_rank_last"]


def print_line(*a: Any) -> None:
    """One write per message, so lines of several ranks sharing a stream never interleave mid-line."""
    sys.stdout.write(" ".join(str(x) for x in a) + "\n")
    sys.stdout.flush()


def print_rank0(*a: Any) -> None:
    if get_rank() == 0:
        print_line(*a)


def print_rank_last(*a: Any) -> None:
    """Megatron prints training and validation lines from the last rank (it holds the loss under PP)."""
    if get_rank() == get_world_size() - 1:
        print_line(*a)
