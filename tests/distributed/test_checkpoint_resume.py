"""Exact resume under TP / DP / ZeRO, and resuming under another layout, with the real trainer.

Each worker runs `Trainer` in-process (gloo, CPU, --mock-data, a tiny model): an uninterrupted
run, a run stopped by --exit-interval that saves, and a run resumed with --load. Same layout:
the losses agree bit for bit (dropout on, so every rank's RNG state must come back too).
Another layout (TP=2 x DP=2 -> TP=1 x DP=4 -> one process, the vocabulary padding kept from the
checkpoint): the continued losses agree with an uninterrupted run to float rounding, which also shows the data position was re-divided over the
new data-parallel ranks (a skipped or repeated sample changes the loss far more).
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest

from dist_harness import run_workers

from megatrain.training.arguments import parse_args
from megatrain.training.logging import parse_train_log_line

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--num-workers", "0", "--lr", "1e-3", "--lr-warmup-iters", "1", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "120", "--log-interval", "1", "--eval-iters", "0",
        "--device", "cpu", "--train-iters", "6"]
HALF = 3


def run_trainer(argv: list[str]) -> tuple[list[tuple[int, float, float]], str]:
    """Train in this process; returns (iteration, loss, grad norm) of the logged lines and the output."""
    from megatrain.training.trainer import Trainer

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        trainer = Trainer(parse_args(argv))
        try:
            trainer.train()
        except SystemExit as e:  # --exit-interval saves and exits
            if e.code not in (0, None):
                raise
        finally:
            trainer.close()
    out = buf.getvalue()
    lines = [parse_train_log_line(l) for l in out.splitlines() if "] iteration " in l]
    return [(d["iteration"], d["lm loss"], d["grad norm"]) for d in lines], out


def _three_runs(layout: list[str], root: str, dropout: list[str]) -> dict:
    save = os.path.join(root, "ckpt")
    full, _ = run_trainer([*BASE, *dropout, *layout])
    first, _ = run_trainer([*BASE, *dropout, *layout, "--save", save, "--exit-interval", str(HALF)])
    second, out = run_trainer([*BASE, *dropout, *layout, "--load", save])
    return {"full": full, "resumed": first + second, "out": out}


def _exact_resume_worker(rank: int, world: int, root: str) -> dict:
    layouts = {"tp2": ["--tensor-model-parallel-size", "2"], "dp2_ddp": [], "dp2_zero3": ["--zero-stage", "3"]}
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    return {name: _three_runs(layout, os.path.join(root, name), dropout) for name, layout in layouts.items()}


@pytest.mark.slow
def test_exact_resume_under_tp_dp_and_zero3(tmp_path):
    results = run_workers(_exact_resume_worker, 2, str(tmp_path))
    last = results[-1]  # the training lines come from the last rank
    for name, r in last.items():
        assert [it for it, _, _ in r["full"]] == list(range(1, 7)), name
        assert r["resumed"] == r["full"], name  # bitwise: loss and grad norm at every iteration
    assert "loaded checkpoint" in results[0]["tp2"]["out"]


NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _layout_change_worker(rank: int, world: int, root: str) -> dict:
    save = os.path.join(root, "ckpt")
    first, _ = run_trainer([*BASE, *NO_DROPOUT, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                            "--save", save, "--exit-interval", str(HALF)])
    second, out = run_trainer([*BASE, *NO_DROPOUT, "--load", save, "--no-save-optim"])  # TP=1 x DP=4 (DDP)
    return {"first": first, "second": second, "out": out}


def _assert_close(got, want) -> None:
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, loss, norm), (_, ref_loss, ref_norm) in zip(got, want):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4)


@pytest.mark.slow
@pytest.mark.long
def test_checkpoint_moves_from_tp2_dp2_to_dp4_and_one_process(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    # One process, uninterrupted, with the vocabulary padded as under TP=2 (120 -> 256; TP=1 pads to 128).
    reference, _ = run_trainer([*BASE, *NO_DROPOUT, "--make-vocab-size-divisible-by", "256"])
    results = run_workers(_layout_change_worker, 4, str(tmp_path))
    last = results[-1]
    _assert_close(last["first"], reference[:HALF])
    _assert_close(last["second"], reference[HALF:])  # TP=1 x DP=4 continues the TP=2 x DP=2 run
    assert "x 4 data-parallel" in results[0]["out"]
    assert "using the checkpoint's padded vocabulary of 256" in results[0]["out"]
    # The same checkpoint in one process (global batch 8 = 4 micro-batches of 2).
    alone, _ = run_trainer([*BASE, *NO_DROPOUT, "--load", str(tmp_path / "ckpt")])
    _assert_close(alone, reference[HALF:])
