"""Manual garbage collection, CUDA cache release points and the profiler window of the training loop."""

from __future__ import annotations

import argparse
import gc
import json

import pytest
import torch

from megatrain.training.housekeeping import Housekeeping


def _args(**kw) -> argparse.Namespace:
    base = dict(manual_gc=False, manual_gc_interval=0, manual_gc_eval=True, empty_unused_memory_level=0,
                profile=False, profile_step_start=10, profile_step_end=12, profile_ranks=[0], profile_dir=None,
                tensorboard_dir=None)
    return argparse.Namespace(**{**base, **kw})


def test_manual_gc_turns_the_collector_off_and_collects_on_schedule(monkeypatch):
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    hk = Housekeeping(_args(manual_gc=True, manual_gc_interval=3), torch.device("cpu"), 0)
    hk.start()
    try:
        assert not gc.isenabled() and len(collected) == 1
        for it in range(1, 7):
            hk.after_optimizer_step(it)
        assert len(collected) == 3  # at iterations 3 and 6
        with hk.around_evaluation():
            pass
        assert len(collected) == 5
    finally:
        hk.close()
    assert gc.isenabled()
    quiet = Housekeeping(_args(manual_gc=True, manual_gc_eval=False), torch.device("cpu"), 0)
    with quiet.around_evaluation():
        pass
    assert len(collected) == 5


def test_profiler_records_its_window_on_the_chosen_ranks(tmp_path):
    hk = Housekeeping(_args(profile=True, profile_step_start=1, profile_step_end=3, tensorboard_dir=str(tmp_path)),
                      torch.device("cpu"), 0)
    x = torch.randn(64, 64)
    for completed in range(5):
        hk.before_iteration(completed)
        x = (x @ x).tanh()
    hk.close()
    assert hk.trace_path == str(tmp_path / "trace_rank0_iters1-3.json")
    trace = json.loads((tmp_path / "trace_rank0_iters1-3.json").read_text())
    assert any("mm" in e.get("name", "") for e in trace["traceEvents"])
    other = Housekeeping(_args(profile=True, profile_step_start=0, profile_step_end=1, profile_dir=str(tmp_path / "x")),
                         torch.device("cpu"), 1)  # rank 1 is not in --profile-ranks
    other.before_iteration(0)
    other.close()
    assert other.trace_path is None and not (tmp_path / "x").exists()


def test_bad_profile_window_and_interval_name_the_flags():
    with pytest.raises(ValueError, match="--profile-step-start"):
        Housekeeping(_args(profile=True, profile_step_start=5, profile_step_end=5), torch.device("cpu"), 0)
    with pytest.raises(ValueError, match="--manual-gc-interval"):
        Housekeeping(_args(manual_gc=True, manual_gc_interval=-1), torch.device("cpu"), 0)
