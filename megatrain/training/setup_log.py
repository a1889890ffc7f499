"""Megatron-LM's set-up lines, so logs read (and parse) as Megatron's do and show where start-up goes:

    time to initialize megatron (seconds): 4.210
    [after megatron is initialized] datetime: 2026-12-06 20:15:01
    [after model, optimizer, and learning rate scheduler are built] datetime: 2026-12-06 20:15:03
    [after dataloaders are built] datetime: 2026-12-06 20:15:03
    done with setup ...
    (min, max) time across ranks (ms):
        model-and-optimizer-setup ......................: (2012.51, 2013.08)
        train/valid/test-data-iterators-setup ..........: (41.37, 44.02)
    training ...
    [before the start of training step] datetime: 2026-12-06 20:15:03

The start time is the earliest over the ranks of :data:`megatrain.START_TIME` (set when the package is
first imported, before torch). Each datetime line waits for every rank first (a barrier), as Megatron's
``print_datetime`` does; the timers' minimum and maximum are over the ranks.
"""

from __future__ import annotations

import time
from datetime import datetime

import torch
import torch.distributed as dist

import megatrain
from megatrain.training.console import print_rank0

__all__ = ["SetupTimers", "print_datetime", "print_time_to_initialize"]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _reduce(values: list[float], op: "dist.ReduceOp", device: torch.device) -> list[float]:
    if not _initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def print_datetime(label: str) -> None:
    """``[label] datetime: YYYY-MM-DD HH:MM:SS `` on rank 0, once every rank got here."""
    if _initialized():
        dist.barrier()
    print_rank0(f"[{label}] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')} ")


def print_time_to_initialize(device: torch.device) -> None:
    """``time to initialize megatron (seconds): X`` from the earliest rank's start, then the datetime line."""
    start = _reduce([megatrain.START_TIME], dist.ReduceOp.MIN, device)[0] if _initialized() else megatrain.START_TIME
    print_rank0(f"time to initialize megatron (seconds): {time.time() - start:.3f}")
    print_datetime("after megatron is initialized")


class SetupTimers:
    """Named wall-clock intervals of the set-up, logged as Megatron's ``timers.log`` does."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._started: dict[str, float] = {}
        self.elapsed: dict[str, float] = {}  # seconds

    def start(self, name: str) -> None:
        self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        self.elapsed[name] = self.elapsed.get(name, 0.0) + time.perf_counter() - self._started.pop(name)

    def log(self, names: list[str]) -> None:
        """``(min, max) time across ranks (ms):`` and one dotted line per timer (every rank takes part)."""
        ms = [self.elapsed.get(n, 0.0) * 1e3 for n in names]
        lows = _reduce(ms, dist.ReduceOp.MIN, self.device)
        highs = _reduce(ms, dist.ReduceOp.MAX, self.device)
        lines = ["(min, max) time across ranks (ms):"]
        lines += [f"    {(n + ' ').ljust(48, '.')}: ({lo:.2f}, {hi:.2f})" for n, lo, hi in zip(names, lows, highs)]
        print_rank0("\n".join(lines))
