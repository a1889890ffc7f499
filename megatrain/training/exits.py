"""Reasons to stop a run early: SIGTERM (``--exit-signal-handler``), ``--exit-duration-in-mins``,
``--exit-interval``; agreed over all ranks so that every rank stops (and saves) at the same iteration."""

from __future__ import annotations

import argparse
import signal
import time
from typing import Any

import torch

from megatrain.parallel.distributed import get_world_size

__all__ = ["ExitRequest"]


class ExitRequest:
    """Collects the reasons to stop early: SIGTERM (with --exit-signal-handler), duration, interval.

    SIGTERM may reach only some ranks and clocks differ, so in a multi-process job the signal and
    duration flags are combined over all ranks every iteration (one tiny all-reduce, only when those
    flags are used): every rank stops, and saves, at the same iteration.
    """

    def __init__(self, args: argparse.Namespace, start_time: float, device: torch.device):
        self.args = args
        self.start_time = start_time
        self.device = device
        self.signal_received = False
        if args.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signal_received = True

    def reason(self, iteration: int) -> str | None:
        minutes = (time.time() - self.start_time) / 60.0
        limit = self.args.exit_duration_in_mins
        signalled, out_of_time = self.signal_received, limit is not None and minutes > limit
        if get_world_size() > 1 and (self.args.exit_signal_handler or limit is not None):
            flags = torch.tensor([float(signalled), float(out_of_time)], device=self.device)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            signalled, out_of_time = (bool(v) for v in flags.tolist())
        if signalled:
            return "received SIGTERM"
        if out_of_time:
            return f"exiting after {minutes:.2f} minutes (--exit-duration-in-mins)"
        if self.args.exit_interval and iteration % self.args.exit_interval == 0:
            return f"exiting at iteration {iteration} (--exit-interval)"
        return None
