"""--rampup-batch-size end to end: the logged batch grows on Megatron's schedule, DP=2 (ZeRO-1) logs
the same losses as one process, and so does PP=2 (one pipeline schedule per micro-batch count); a
run stopped in the middle of the ramp resumes exactly."""

from __future__ import annotations

import sys

import pytest

from megatrain.training.logging import parse_train_log_line
from tests.e2e.conftest import cpu_env, run_cmd

RUN = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size",
       "16", "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--mock-data",
       "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--lr", "1e-3", "--lr-warmup-samples", "8",
       "--train-samples", "120", "--rampup-batch-size", "4", "4", "48", "--log-interval", "1", "--eval-iters", "0",
       "--device", "cpu"]


def _lines(stdout: str) -> list[dict]:
    return [parse_train_log_line(line) for line in stdout.splitlines() if "] iteration " in line]


@pytest.mark.slow
@pytest.mark.long  # the schedule itself is tests/unit/test_batch_rampup.py's
def test_rampup_schedule_data_parallel_and_resume(tmp_path):
    full = _lines(run_cmd([sys.executable, *RUN], env=cpu_env()).stdout)
    assert [d["global batch size"] for d in full] == [4, 4, 4, 4, 8, 8, 12, 12, 16, 16, 16, 16]
    assert [d["consumed samples"] for d in full][-1] == 120
    dp2 = _lines(run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                          *RUN, "--use-distributed-optimizer"], env=cpu_env()).stdout)
    pp2 = _lines(run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                          *RUN, "--pipeline-model-parallel-size", "2"], env=cpu_env()).stdout)
    for a, b, c in zip(full, dp2, pp2, strict=True):
        assert b["lm loss"] == pytest.approx(a["lm loss"], rel=1e-5)
        assert c["lm loss"] == pytest.approx(a["lm loss"], rel=1e-5)  # one pipeline schedule per batch size
        assert b["global batch size"] == c["global batch size"] == a["global batch size"]
    _assert_resumes_exactly(RUN, full, tmp_path / "ckpt", stop_at=6)


def _assert_resumes_exactly(run: list[str], full: list[dict], save, stop_at: int) -> None:
    """``run`` stopped after ``stop_at`` iterations and resumed logs what the uninterrupted run logged."""
    first = _lines(run_cmd([sys.executable, *run, "--save", str(save), "--exit-interval", str(stop_at)],
                           env=cpu_env()).stdout)
    second = _lines(run_cmd([sys.executable, *run, "--load", str(save)], env=cpu_env()).stdout)
    assert [d["iteration"] for d in first + second] == list(range(1, len(full) + 1))
    for a, b in zip(full, first + second):
        assert (a["lm loss"], a["learning rate"], a["global batch size"]) == \
               (b["lm loss"], b["learning rate"], b["global batch size"]), (a, b)


def test_step_batch_size_schedule_of_megatrons_gpt3_example_runs_and_resumes_across_a_step(tmp_path):
    """Megatron-LM's GPT-3 175B example passes --global-batch-size with --step-batch-size-schedule (thresholds in
    tokens): the logged batch follows the schedule, and a run stopped before a step resumes exactly."""
    start = RUN.index("--lr-warmup-samples")
    run = [*RUN[:start], *RUN[RUN.index("--log-interval"):], "--train-iters", "6", "--lr-warmup-iters", "1",
           "--step-batch-size-schedule", "0:4 0.256K:8 512:16"]
    assert "--global-batch-size" in run and "--rampup-batch-size" not in run and "--train-samples" not in run
    full = _lines(run_cmd([sys.executable, *run], env=cpu_env()).stdout)
    # thresholds 0, 8, 16 samples (tokens // --seq-length 32): 4, 4 (8 consumed), 8 (16), then 16
    assert [d["global batch size"] for d in full] == [4, 4, 8, 16, 16, 16]
    _assert_resumes_exactly(run, full, tmp_path / "ckpt", stop_at=2)
