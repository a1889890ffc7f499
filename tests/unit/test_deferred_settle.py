"""An iteration whose optimizer step the device can skip by itself (fused kernels, no loss scaling)
stays pending: the host reads its flags when the next iteration's optimizer step is about to be
queued, or when the training loop needs its result. The numbers must not change."""

from __future__ import annotations

import os

import torch

from megatrain.training.arguments import parse_args
from megatrain.training.trainer import Trainer

ARGS = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", "6",
        "--num-workers", "0", "--lr", "1e-2", "--lr-warmup-iters", "3", "--mock-data", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
        "--log-interval", "3", "--eval-iters", "0", "--train-iters", "7", "--bf16", "--no-torch-compile",
        "--device", "cpu", "--clip-grad", "1.0"]


def _trainer() -> Trainer:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    t = Trainer(parse_args(ARGS))
    for group in [t.optimizer.defaults, *t.optimizer.param_groups]:  # the device-side skipping kernels
        group["fused"], group["foreach"] = True, False
    return t


def test_the_schedule_advances_before_the_next_optimizer_step_is_queued():
    t = _trainer()
    try:
        lrs = [t.scheduler.get_lr(step) for step in range(3)]
        assert len(set(lrs)) == 3  # warm-up: every step has its own LR
        t.queue_step()
        assert t._pending is not None and t._pending.iteration == 1
        assert t.scheduler.num_steps == 0 and t.interval.iterations == 0  # not read yet
        t.state.iteration += 1
        t.queue_step()  # settles iteration 1 before queuing its own step
        assert t._pending is not None and t._pending.iteration == 2
        assert t.scheduler.num_steps == 6 and t.interval.iterations == 1 and t.last_result[0] == 1
        result = t.settle()
        assert result is not None and not result.skipped and result.grad_norm > 0
        assert t.settle() is None and t.scheduler.num_steps == 12 and t.last_result == (2, result)
    finally:
        t.close()


def test_deferred_settling_trains_like_settling_every_iteration(capsys):
    """train() (settling late) and train_step() per iteration (settling at once): same weights,
    optimizer states, schedule and losses."""
    lagging, eager = _trainer(), _trainer()
    try:
        state = lagging.train()
        assert state.iteration == 7 and lagging._pending is None
        logged = [line for line in capsys.readouterr().out.splitlines() if "] iteration " in line]
        assert len(logged) == 2  # iterations 3 and 6
        results = [eager.train_step() for _ in range(7)]
        assert lagging.last_result == (7, results[-1])
        assert lagging.scheduler.num_steps == eager.scheduler.num_steps == 42
        for (name, a), b in zip(lagging.module.named_parameters(), eager.module.parameters()):
            assert torch.equal(a, b), name
            sa, sb = lagging.optimizer.state[a], eager.optimizer.state[b]
            assert all(torch.equal(sa[k], sb[k]) for k in sa), name
        mean_4_to_6 = sum(r.loss for r in results[3:6]) / 3
        assert f"lm loss: {mean_4_to_6:E}" in logged[1]
    finally:
        lagging.close()
        eager.close()


def test_a_log_line_waits_for_the_next_iterations_work_to_be_queued(capsys):
    """With nothing but the log line due, the host does not wait for the iteration: its line is printed
    once the next iteration's forward and backward are queued (the device does not idle for the host's
    logging), with the same values."""
    t = _trainer()
    printed: list[tuple[int, int | None]] = []
    log_line = t._log_line

    def spy(*args, **kwargs):
        printed.append((t.state.iteration, t._pending.iteration if t._pending is not None else None))
        return log_line(*args, **kwargs)

    t._log_line = spy
    try:
        t.args.log_interval = 2  # lines at 2, 4 and 6, each printed after the next iteration is queued
        t.args.train_iters = 7
        t.train()
        assert printed == [(2, 3), (4, 5), (6, 7)]
        logged = [line for line in capsys.readouterr().out.splitlines() if "] iteration " in line]
        assert [int(line.split("iteration")[1].split("/")[0]) for line in logged] == [2, 4, 6]
    finally:
        t.close()
