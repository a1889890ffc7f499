"""A Megatron-LM checkpoint continues training in megatrain: a LLaMA-style run saves at iteration 3, the
checkpoint is written as Megatron's torch_dist (``tools/checkpoint/convert.py --saver mcore``) and legacy torch
format (TP=2 x PP=2), and ``pretrain_gpt.py --load MEGATRON_DIR --use-checkpoint-args`` (no model flags given)
resumes at iteration 4: with ``--no-load-optim``, with exactly the losses of megatrain's own resume without
optimizer state; without it (both formats carry Adam's moments, the legacy one by parameter index in each rank
file, and the LR schedule), with exactly the losses and learning rates of megatrain's full resume. An ``--fp16``
run's dynamic loss scaler travels too: the resumed losses and loss scales are megatrain's full resume's."""

from __future__ import annotations

import sys

import pytest

from tests.e2e.conftest import cpu_env, run_cmd
from megatrain.training.logging import parse_train_log_line

pytestmark = pytest.mark.slow

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "48", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--max-position-embeddings", "32"]
RUN = ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
       "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--mock-data", "--tokenizer-type",
       "NullTokenizer", "--vocab-size", "500", "--log-interval", "1", "--eval-iters", "0", "--device", "cpu"]


def _logged(stdout: str, key: str) -> dict[int, float]:
    lines = [parse_train_log_line(l) for l in stdout.splitlines() if "] iteration " in l]
    return {int(d["iteration"]): d[key] for d in lines}


def _losses(stdout: str) -> dict[int, float]:
    return _logged(stdout, "lm loss")


def _megatrain_runs(tmp_path, env) -> tuple:
    """A 3-iteration megatrain run saved at iteration 3, its resume to 6 without optimizer state (the losses a
    --no-load-optim start must give) and its full resume (the schedule overridden as the Megatron starts are)."""
    first = tmp_path / "first"
    run_cmd([sys.executable, "pretrain_gpt.py", *MODEL, *RUN, "--train-iters", "3", "--save", str(first),
             "--save-interval", "3"], env=env)
    reference = run_cmd([sys.executable, "pretrain_gpt.py", *MODEL, *RUN, "--train-iters", "6", "--load", str(first),
                         "--no-load-optim", "--no-load-rng"], env=env)
    assert sorted(_losses(reference.stdout)) == [4, 5, 6]
    # (--override-opt_param-scheduler: a 6-iteration run's decay length against the 3-iteration run's, as Megatron)
    full = run_cmd([sys.executable, "pretrain_gpt.py", *MODEL, *RUN, "--train-iters", "6", "--load", str(first),
                    "--no-load-rng", "--override-opt_param-scheduler"], env=env)
    return first, reference, full


CONVERT = [sys.executable, "tools/checkpoint/convert.py", "--model-type", "GPT", "--no-progress"]


def _resume(source, save, *extra: str, env):
    return run_cmd([sys.executable, "pretrain_gpt.py", *RUN, "--use-checkpoint-args", "--train-iters", "6",
                    "--load", str(source), "--save", str(save), *extra], env=env)


def _assert_no_optim_resume(proc, reference, save) -> None:
    assert _losses(proc.stdout) == _losses(reference.stdout)
    assert "model flags from the Megatron-LM checkpoint" in proc.stdout + proc.stderr
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


def _assert_full_resume(proc, full) -> None:
    assert _losses(proc.stdout) == _losses(full.stdout)
    assert _logged(proc.stdout, "learning rate") == _logged(full.stdout, "learning rate")
    assert "optimizer starts fresh" not in proc.stdout + proc.stderr


def test_megatron_checkpoint_continues_training(tmp_path):
    """torch_dist (--saver mcore): --no-load-optim gives megatrain's resume without optimizer state; without it
    the LR schedule travels through common.pt's opt_param_scheduler and continues where it stopped (megatrain's
    full resume's rates), and Adam's moments travel in the torch_dist files (megatrain's full resume's losses)."""
    env = cpu_env()
    first, reference, full = _megatrain_runs(tmp_path, env)
    dist = tmp_path / "megatron_dist"
    run_cmd(CONVERT + ["--loader", "megatrain", "--saver", "mcore", "--load-dir", str(first), "--save-dir", str(dist)],
            env=env)
    save = tmp_path / "resumed_megatron_dist"
    _assert_no_optim_resume(_resume(dist, save, "--no-load-optim", env=env), reference, save)
    proc = _resume(dist, tmp_path / "resumed_schedule", "--override-opt_param-scheduler", env=env)
    _assert_full_resume(proc, full)
    assert _logged(proc.stdout, "learning rate") != _logged(reference.stdout, "learning rate")


@pytest.mark.long  # ~20 s; the start converts either format with import_megatron, whose reading of legacy files
# (TP=2 x PP=2, with Adam's state by index) is unit tests (test_megatron_ckpt.py, test_megatron_legacy_optim.py)
def test_megatron_legacy_checkpoint_continues_training(tmp_path):
    """The legacy torch format (TP=2 x PP=2): converted from torch_dist by the mcore loader (no optimizer state),
    the losses of megatrain's resume without optimizer state; written by --saver megatron with Adam's state (by
    parameter index in each rank file), those of megatrain's full resume."""
    env = cpu_env()
    first, reference, full = _megatrain_runs(tmp_path, env)
    dist, legacy = tmp_path / "megatron_dist", tmp_path / "megatron_legacy"
    layout = ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]
    run_cmd(CONVERT + ["--loader", "megatrain", "--saver", "mcore", "--load-dir", str(first), "--save-dir", str(dist)],
            env=env)
    run_cmd(CONVERT + ["--loader", "mcore", "--saver", "megatron", "--load-dir", str(dist), "--save-dir", str(legacy),
                       *layout], env=env)
    save = tmp_path / "resumed_megatron_legacy"
    _assert_no_optim_resume(_resume(legacy, save, "--no-load-optim", env=env), reference, save)
    legacy_adam = tmp_path / "megatron_legacy_adam"
    run_cmd(CONVERT + ["--loader", "megatrain", "--saver", "megatron", "--load-dir", str(first), "--save-dir",
                       str(legacy_adam), *layout], env=env)
    _assert_full_resume(_resume(legacy_adam, tmp_path / "resumed_legacy_adam", "--override-opt_param-scheduler",
                                env=env), full)


@pytest.mark.long  # ~22 s; the scaler's round trips are unit tests (test_megatron_legacy_optim.py)
def test_megatron_checkpoint_continues_fp16_training(tmp_path):
    """--fp16 (a dynamic loss scaler; --loss-scale-window 2 so that it moves): through both Megatron formats the
    resumed run's losses and loss scales are megatrain's own full resume's."""
    env = cpu_env()
    fp16 = ["--fp16", "--initial-loss-scale", "4096", "--loss-scale-window", "2"]
    first = tmp_path / "first"
    run_cmd([sys.executable, "pretrain_gpt.py", *MODEL, *RUN, *fp16, "--train-iters", "3", "--save", str(first),
             "--save-interval", "3"], env=env)
    full = run_cmd([sys.executable, "pretrain_gpt.py", *MODEL, *RUN, *fp16, "--train-iters", "6", "--load",
                    str(first), "--no-load-rng", "--override-opt_param-scheduler"], env=env)
    want_scales = _logged(full.stdout, "loss scale")
    assert sorted(want_scales) == [4, 5, 6] and want_scales[4] != 4096.0  # it grew in the first run
    base = [sys.executable, "tools/checkpoint/convert.py", "--model-type", "GPT", "--no-progress", "--loader",
            "megatrain", "--load-dir", str(first)]
    for saver, layout in (("mcore", []), ("megatron", ["--target-tensor-parallel-size", "2"])):
        out = tmp_path / f"megatron_{saver}"
        run_cmd(base + ["--saver", saver, "--save-dir", str(out), *layout], env=env)
        proc = run_cmd([sys.executable, "pretrain_gpt.py", *RUN, *fp16, "--use-checkpoint-args", "--train-iters",
                        "6", "--load", str(out), "--save", str(tmp_path / f"resumed_{saver}"),
                        "--override-opt_param-scheduler"], env=env)
        assert _logged(proc.stdout, "loss scale") == want_scales, saver
        assert _losses(proc.stdout) == _losses(full.stdout), saver
        assert "optimizer starts fresh" not in proc.stdout + proc.stderr
