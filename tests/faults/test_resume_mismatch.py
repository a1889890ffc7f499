"""Resuming under other flags than the checkpoint's, with real `pretrain_gpt.py` runs: a different
LR schedule is refused unless --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler
says which side wins (the resumed iterations then log the LR Megatron-LM's semantics give), and a
different model configuration with the same tensor shapes is refused unless --use-checkpoint-args."""

from __future__ import annotations

import sys

import pytest

from megatrain.training.arguments import parse_args
from megatrain.training.logging import parse_train_log_line
from megatrain.training.lr_schedule import LRScheduleConfig, LRScheduler
from tests.e2e.conftest import cpu_env, run_cmd

GBS = 2
MODEL = ["--num-layers", "1", "--hidden-size", "32", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", str(GBS), "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--log-interval", "1",
         "--eval-iters", "0", "--device", "cpu"]
SCHEDULE = ["--lr-warmup-iters", "2", "--lr-decay-style", "linear", "--min-lr", "1e-4"]
SAVED_AT, TRAIN_ITERS, LR = 3, 6, 1e-3


def _run(ckpt, *flags: str, check: bool = True):
    return run_cmd([sys.executable, "pretrain_gpt.py", *MODEL, *SCHEDULE, "--load", str(ckpt), *flags],
                   env=cpu_env(), check=check)


def _logged_lrs(stdout: str) -> dict[int, float]:
    lines = [parse_train_log_line(l) for l in stdout.splitlines() if "] iteration " in l]
    return {d["iteration"]: d["learning rate"] for d in lines}


def _expected_lrs(lr: float, train_iters: int) -> dict[int, float]:
    """The LR logged after iteration k: the schedule at k x global batch samples (Megatron's step
    count, restored from the checkpoint), with the decay over --train-iters."""
    s = LRScheduler(None, LRScheduleConfig(lr=lr, min_lr=1e-4, lr_decay_style="linear",
                                           lr_decay_steps=train_iters * GBS, lr_warmup_steps=2 * GBS))
    return {k: s.get_lr(k * GBS) for k in range(SAVED_AT + 1, train_iters + 1)}


def _refusal(proc) -> list[str]:
    """The lines of a refusal that name a difference (indented under the error line)."""
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    return [l for l in proc.stderr.splitlines() if l.startswith("  ")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint at iteration 3 of a 6-iteration run (--lr 1e-3, 4 attention heads)."""
    save = tmp_path_factory.mktemp("resume") / "ckpt"
    run_cmd([sys.executable, "pretrain_gpt.py", *MODEL, *SCHEDULE, "--num-attention-heads", "4", "--lr", str(LR),
             "--train-iters", str(TRAIN_ITERS), "--exit-interval", str(SAVED_AT), "--save", str(save)], env=cpu_env())
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(SAVED_AT)
    return save


def test_another_lr_is_refused_with_one_line_naming_both_ways_out(ckpt):
    proc = _run(ckpt, "--num-attention-heads", "4", "--lr", "2e-3", "--train-iters", str(TRAIN_ITERS), check=False)
    assert _refusal(proc) == ["  learning rate (--lr): checkpoint 0.001, flags 0.002"]
    assert "--override-opt_param-scheduler" in proc.stderr and "--use-checkpoint-opt_param-scheduler" in proc.stderr


def test_the_checkpoints_schedule_with_use_checkpoint(ckpt):
    """The checkpoint's peak LR (and --min-lr) at the checkpoint's step count: no second warmup."""
    flag = "--use-checkpoint-opt_param-scheduler"
    proc = _run(ckpt, "--num-attention-heads", "4", "--lr", "2e-3", "--train-iters", str(TRAIN_ITERS), flag)
    assert f"note: {flag}" in proc.stdout and "learning rate (--lr): checkpoint 0.001, flags 0.002" in proc.stdout
    assert _logged_lrs(proc.stdout) == pytest.approx(_expected_lrs(LR, TRAIN_ITERS), rel=1e-6)


def test_a_longer_run_is_refused_then_decays_over_the_new_length_with_override(ckpt):
    """A longer --train-iters lengthens the decay (--lr-decay-iters defaults to it) and the
    weight-decay schedule: refused, one line each. With --override-opt_param-scheduler the flags'
    peak LR and length run from the checkpoint's step count (no second warmup), so the extension
    trains at the schedule's LR, not at the minimum past the old end."""
    longer = ["--num-attention-heads", "4", "--lr", "2e-3", "--train-iters", "10"]
    lines = _refusal(_run(ckpt, *longer, check=False))
    assert len(lines) == 3 and lines[0] == "  learning rate (--lr): checkpoint 0.001, flags 0.002"
    assert "decay length (--train-iters" in lines[1] and "--lr-decay-iters defaults" in lines[1]
    assert "checkpoint 12 samples (6 iterations), flags 20 samples (10 iterations)" in lines[1]
    assert lines[2].startswith("  weight-decay increment length (--train-iters")
    proc = _run(ckpt, *longer, "--override-opt_param-scheduler")
    assert "note: --override-opt_param-scheduler" in proc.stdout
    got = _logged_lrs(proc.stdout)
    assert got == pytest.approx(_expected_lrs(2e-3, 10), rel=1e-6)
    assert all(got[k] > 1e-4 for k in range(SAVED_AT + 1, 10))


def test_other_heads_over_the_same_hidden_size_are_refused_unless_use_checkpoint_args(ckpt):
    same = ["--lr", str(LR), "--train-iters", str(TRAIN_ITERS)]
    lines = _refusal(_run(ckpt, "--num-attention-heads", "2", *same, check=False))
    assert "  --num-attention-heads: checkpoint 4, flags 2" in lines
    assert not [l for l in lines if "shape differs" in l]  # same tensor shapes: only the config tells
    proc = _run(ckpt, "--num-attention-heads", "2", *same, "--use-checkpoint-args")
    assert "--num-attention-heads 4" in proc.stdout and "loaded checkpoint" in proc.stdout
    assert sorted(_logged_lrs(proc.stdout)) == list(range(SAVED_AT + 1, TRAIN_ITERS + 1))


def test_both_scheduler_flags_together_are_refused():
    with pytest.raises(SystemExit, match="only one of --override-opt_param-scheduler"):
        parse_args([*MODEL, "--num-attention-heads", "4", "--lr", "1e-3", "--train-iters", "2",
                    "--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"])
