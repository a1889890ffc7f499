"""`pretrain_gpt.py` end to end on a real preprocessed corpus: logs, loss, validation, TensorBoard,
checkpoints, exact resume, and generation from the checkpoint."""

from __future__ import annotations

import json
import sys

import pytest

from megatrain.training.logging import parse_train_log_line, parse_validation_line
from tests.e2e.conftest import run_and_signal, run_cmd

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0"]


def train_lines(stdout: str) -> list[dict]:
    return [parse_train_log_line(line) for line in stdout.splitlines() if "] iteration " in line]


def test_pretrain_logs_loss_validation_tensorboard_and_generates(tiny_corpus, tmp_path):
    tb = tmp_path / "tb"
    save = tmp_path / "ckpt"
    proc = run_cmd([sys.executable, "pretrain_gpt.py", *MODEL, "--train-iters", "60", "--lr", "3e-3",
                    "--lr-decay-style", "cosine", "--lr-warmup-iters", "5", "--data-path", tiny_corpus["data_path"],
                    "--split", "90,10,0", *tiny_corpus["tok_flags"], "--log-interval", "10", "--eval-interval", "30",
                    "--eval-iters", "2", "--tensorboard-dir", str(tb), "--save", str(save)])
    lines = train_lines(proc.stdout)
    assert [d["iteration"] for d in lines] == [10, 20, 30, 40, 50, 60]
    # Megatron's set-up lines, in Megatron's order, before the first iteration's line
    setup = [l for l in proc.stdout.splitlines()[:proc.stdout.splitlines().index(
        next(l for l in proc.stdout.splitlines() if "] iteration " in l))]]
    order = ["time to initialize megatron (seconds): ", "[after megatron is initialized] datetime: ",
             "[after model, optimizer, and learning rate scheduler are built] datetime: ",
             "[after dataloaders are built] datetime: ", "done with setup ...", "(min, max) time across ranks (ms):",
             "    model-and-optimizer-setup ......................: (", "    train/valid/test-data-iterators-setup ..........: (",
             "training ...", "[before the start of training step] datetime: "]
    found = [next(i for i, l in enumerate(setup) if l.startswith(prefix)) for prefix in order]
    assert found == sorted(found), setup
    assert "[after training is done] datetime: " in proc.stdout
    losses = [d["lm loss"] for d in lines]
    assert losses[-1] < losses[0] - 0.5 and losses[-1] < min(losses[:3]), losses  # clearly falling
    assert all(d["consumed samples"] == d["iteration"] * 8 for d in lines)
    assert all(d["global batch size"] == 8 for d in lines)
    valid = [parse_validation_line(l) for l in proc.stdout.splitlines() if "validation loss at" in l]
    assert len(valid) == 3 and valid[0]["iteration"] == 30 and valid[-1]["where"] == "iteration 60 on validation set"
    assert valid[-1]["lm loss value"] < losses[0]
    assert list(tb.glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "60"
    assert (save / "iter_0000060" / "meta.json").is_file()

    out = tmp_path / "gen.json"
    proc = run_cmd([sys.executable, "tools/generate.py", "--load", str(save), "--prompt", "def ", "--prompt",
                    "import", "--tokens-to-generate", "8", "--greedy", "--output-json", str(out)])
    results = json.loads(out.read_text())
    assert [r["prompt"] for r in results] == ["def ", "import"]
    assert all(1 <= len(r["tokens"]) <= 8 and isinstance(r["text"], str) for r in results)


@pytest.mark.slow
@pytest.mark.long  # exact resume also runs in tests/distributed/test_checkpoint_resume.py under TP, DP and ZeRO-3
@pytest.mark.parametrize("loader", ["single", "cyclic"])
def test_exact_resume_gives_identical_losses(tiny_corpus, tmp_path, loader):
    common = [sys.executable, "pretrain_gpt.py", *MODEL, "--train-iters", "12", "--lr", "1e-3",
              "--lr-warmup-iters", "2", "--data-path", tiny_corpus["data_path"], "--split", "90,10,0",
              *tiny_corpus["tok_flags"], "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
              "--dataloader-type", loader]
    full = train_lines(run_cmd(common).stdout)
    save = tmp_path / "ckpt"
    first = train_lines(run_cmd([*common, "--save", str(save), "--exit-interval", "6"]).stdout)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    second = train_lines(run_cmd([*common, "--load", str(save)]).stdout)
    assert [d["iteration"] for d in first + second] == list(range(1, 13))
    for a, b in zip(full, first + second):
        assert a["lm loss"] == b["lm loss"] and a["learning rate"] == b["learning rate"], (a, b)
        assert a["grad norm"] == b["grad norm"]


def test_bad_flags_fail_before_work(tmp_path):
    proc = run_cmd([sys.executable, "pretrain_gpt.py", *MODEL, "--train-iters", "2", "--lr", "1e-3",
                    "--data-path", str(tmp_path / "missing"), "--tokenizer-type", "NullTokenizer",
                    "--vocab-size", "100"], check=False)
    assert proc.returncode != 0
    assert "missing" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cmd([sys.executable, "pretrain_gpt.py", *MODEL, "--train-iters", "2", "--lr", "1e-3", "--mock-data",
                    "--fp16", "--bf16"], check=False)
    assert proc.returncode != 0 and "--fp16 and --bf16" in proc.stderr


MOCK = [*MODEL, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--eval-iters", "0"]


def test_fp16_overflow_skips_iterations_and_backs_off_the_scale():
    proc = run_cmd([sys.executable, "pretrain_gpt.py", *MOCK, "--train-iters", "6", "--lr", "1e-3", "--fp16",
                    "--initial-loss-scale", "1e38", "--hysteresis", "1", "--log-interval", "3"])
    lines = train_lines(proc.stdout)
    assert lines[0]["number of skipped iterations"] == 3
    assert lines[1]["loss scale"] < lines[0]["loss scale"] < 1e38
    assert lines[0]["learning rate"] == 1e-3  # the schedule does not advance on skipped steps


def test_nan_iterations_are_counted_and_stop_the_run():
    proc = run_cmd([sys.executable, "pretrain_gpt.py", *MOCK, "--train-iters", "30", "--lr", "1e30", "--clip-grad",
                    "0", "--log-interval", "1", "--max-nan-iterations", "3"], check=False)
    assert proc.returncode != 0
    assert "--max-nan-iterations 3" in proc.stderr
    lines = train_lines(proc.stdout)
    assert sum(d["number of nan iterations"] for d in lines) == 3


def test_sigterm_with_exit_signal_handler_saves_and_exits_cleanly(tmp_path):
    import os

    save = tmp_path / "ckpt"
    proc = run_and_signal([sys.executable, "pretrain_gpt.py", *MOCK, "--train-iters", "100000", "--lr", "1e-3",
                           "--log-interval", "1", "--exit-signal-handler", "--save", str(save)],
                          when="] iteration ")  # training is under way
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, err
    assert "received SIGTERM" in out
    iteration = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= iteration < 100000 and (save / f"iter_{iteration:07d}" / "meta.json").is_file()
    assert not [n for n in os.listdir(save) if n.endswith(".tmp")]  # no half-written checkpoint left


def test_exit_duration_saves_before_exiting(tmp_path):
    save = tmp_path / "ckpt"
    proc = run_cmd([sys.executable, "pretrain_gpt.py", *MOCK, "--train-iters", "100000", "--lr", "1e-3",
                    "--log-interval", "1", "--exit-duration-in-mins", "0", "--save", str(save)])
    assert "--exit-duration-in-mins" in proc.stdout
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_use_checkpoint_args_and_exit_on_missing_checkpoint(tmp_path):
    """--use-checkpoint-args builds the checkpoint's model whatever the shape flags say (and without
    them); --exit-on-missing-checkpoint refuses an empty --load instead of starting fresh."""
    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--lr", "1e-3",
            "--log-interval", "1", "--eval-iters", "0", "--device", "cpu", "--micro-batch-size", "2"]
    shape = ["--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "6", "--seq-length", "32",
             "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--apply-layernorm-1p"]
    ckpt = tmp_path / "ckpt"
    run_cmd([sys.executable, "pretrain_gpt.py", *shape, *data, "--train-iters", "2", "--save", str(ckpt)])
    longer = ["--train-iters", "3", "--override-opt_param-scheduler"]  # a longer run: the flags' schedule
    proc = run_cmd([sys.executable, "pretrain_gpt.py", *data, *longer, "--load", str(ckpt),
                    "--use-checkpoint-args", "--exit-on-missing-checkpoint"])
    assert "note: --use-checkpoint-args took the model shape from" in proc.stdout
    assert "--num-layers 3" in proc.stdout and "--apply-layernorm-1p True" in proc.stdout
    assert "loaded checkpoint" in proc.stdout and "] iteration        3/       3 |" in proc.stdout
    wrong = run_cmd([sys.executable, "pretrain_gpt.py", *data, "--num-layers", "2", "--hidden-size", "64",
                     "--num-attention-heads", "4", "--seq-length", "32", *longer, "--load", str(ckpt),
                     "--use-checkpoint-args"])
    assert "--hidden-size 48" in wrong.stdout and "] iteration        3/       3 |" in wrong.stdout
    (tmp_path / "empty").mkdir()
    missing = run_cmd([sys.executable, "pretrain_gpt.py", *shape, *data, "--train-iters", "2", "--load",
                       str(tmp_path / "empty"), "--exit-on-missing-checkpoint"], check=False)
    assert missing.returncode != 0 and "no complete checkpoint found (--exit-on-missing-checkpoint)" in missing.stderr


@pytest.mark.long
def test_a_checkpoints_gelu_is_kept_by_use_checkpoint_args_and_warned_about_otherwise(tmp_path):
    """A model trained with exact GELU (--no-bias-gelu-fusion) and loaded without the flag: a warning
    names both GELUs; --use-checkpoint-args takes the checkpoint's."""
    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--lr", "1e-3",
            "--log-interval", "1", "--eval-iters", "0", "--device", "cpu", "--micro-batch-size", "2",
            "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
    ckpt = tmp_path / "ckpt"
    run_cmd([sys.executable, "pretrain_gpt.py", *data, "--train-iters", "1", "--no-bias-gelu-fusion", "--save", str(ckpt)])
    longer = ["--train-iters", "2", "--override-opt_param-scheduler"]  # a longer run: the flags' schedule
    plain = run_cmd([sys.executable, "pretrain_gpt.py", *data, *longer, "--load", str(ckpt)])
    assert "trained with exact GELU and the flags give tanh-approximated GELU" in plain.stdout + plain.stderr
    taken = run_cmd([sys.executable, "pretrain_gpt.py", *data, *longer, "--load", str(ckpt),
                     "--use-checkpoint-args"])
    assert "--no-bias-gelu-fusion" in taken.stdout and "trained with exact GELU" not in taken.stdout + taken.stderr
    assert "] iteration        2/       2 |" in taken.stdout
