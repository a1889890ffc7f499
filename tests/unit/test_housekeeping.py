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


def test_memory_history_on_a_cpu_run_is_a_note_and_writes_nothing(tmp_path):
    from megatrain.training.arguments import parse_args

    argv = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--device", "cpu",
            "--record-memory-history", "--memory-snapshot-path", str(tmp_path / "mem.pickle")]
    args = parse_args(argv, validate=True)
    assert any(n.startswith("note: --record-memory-history records the CUDA caching allocator")
               for n in args.legacy_notes)
    hk = Housekeeping(args, torch.device("cpu"), 0)
    hk.after_log()
    hk.close()
    assert hk.snapshot_path is None and list(tmp_path.iterdir()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_history_writes_the_ranks_snapshot_at_each_log_line(tmp_path):
    import pickle

    hk = Housekeeping(_args(record_memory_history=True, memory_snapshot_path=str(tmp_path / "run" / "mem.pickle")),
                      torch.device("cuda"), 0)
    try:
        x = torch.randn(1024, 1024, device="cuda")
        y = x @ x
        hk.after_log()
        path = tmp_path / "run" / "mem_0.pickle"
        with open(path, "rb") as f:  # our own snapshot, written by torch in this test
            snapshot = pickle.load(f)
        assert snapshot["segments"] and any(t for t in snapshot["device_traces"]), "no allocation history"
        del y
    finally:
        hk.close()
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["mem_0.pickle"]  # no temporary left
    other = Housekeeping(_args(record_memory_history=True, memory_snapshot_path=str(tmp_path / "o.pickle")),
                         torch.device("cuda"), 1)  # rank 1 is not in --profile-ranks
    assert other.snapshot_path is None
