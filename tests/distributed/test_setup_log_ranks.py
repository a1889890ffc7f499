"""Megatron's set-up lines over gloo ranks: the timers' (min, max) across ranks, the start time of the
earliest rank, printed once (rank 0)."""

from __future__ import annotations

import contextlib
import io
import re

from dist_harness import run_workers


def _lines(rank: int, world_size: int) -> str:
    import torch

    import megatrain
    from megatrain.training.setup_log import SetupTimers, print_datetime, print_time_to_initialize

    megatrain.START_TIME -= 100.0 * (rank + 1)  # rank 1 "started" earliest
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_time_to_initialize(torch.device("cpu"))
        timers = SetupTimers(torch.device("cpu"))
        timers.elapsed = {"model-and-optimizer-setup": 1.0 + rank, "train/valid/test-data-iterators-setup": 0.25}
        timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"])
        print_datetime("after dataloaders are built")
    return out.getvalue()


def test_setup_lines_reduce_over_ranks_and_print_once():
    first, second = run_workers(_lines, 2)
    assert second == ""
    lines = first.splitlines()
    seconds = float(re.fullmatch(r"time to initialize megatron \(seconds\): (\d+\.\d{3})", lines[0]).group(1))
    assert 200.0 <= seconds < 260.0  # from the earliest rank's start
    assert re.fullmatch(r"\[after megatron is initialized\] datetime: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", lines[1])
    assert lines[2:5] == ["(min, max) time across ranks (ms):",
                          "    model-and-optimizer-setup ......................: (1000.00, 2000.00)",
                          "    train/valid/test-data-iterators-setup ..........: (250.00, 250.00)"]
    assert lines[5].startswith("[after dataloaders are built] datetime: ")
