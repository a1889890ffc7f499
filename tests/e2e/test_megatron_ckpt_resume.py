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


def test_megatron_checkpoint_continues_training(tmp_path):
    env = cpu_env()
    first = tmp_path / "first"
    run_cmd([sys.executable, "pretrain_gpt.py", *MODEL, *RUN, "--train-iters", "3", "--save", str(first),
             "--save-interval", "3"], env=env)
    reference = run_cmd([sys.executable, "pretrain_gpt.py", *MODEL, *RUN, "--train-iters", "6", "--load", str(first),
                         "--no-load-optim", "--no-load-rng"], env=env)
    want = _losses(reference.stdout)
    assert sorted(want) == [4, 5, 6]
    dist, legacy = tmp_path / "megatron_dist", tmp_path / "megatron_legacy"
    base = [sys.executable, "tools/checkpoint/convert.py", "--model-type", "GPT", "--no-progress"]
    run_cmd(base + ["--loader", "megatrain", "--saver", "mcore", "--load-dir", str(first), "--save-dir", str(dist)],
            env=env)
    run_cmd(base + ["--loader", "mcore", "--saver", "megatron", "--load-dir", str(dist), "--save-dir", str(legacy),
                    "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"], env=env)
    for source in (dist, legacy):
        save = tmp_path / f"resumed_{source.name}"
        proc = run_cmd([sys.executable, "pretrain_gpt.py", *RUN, "--use-checkpoint-args", "--train-iters", "6",
                        "--load", str(source), "--save", str(save), "--no-load-optim"], env=env)
        got = _losses(proc.stdout)
        assert got == want, (source.name, got, want)
        assert "model flags from the Megatron-LM checkpoint" in proc.stdout + proc.stderr
        assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    # Without --no-load-optim the LR schedule travels through common.pt's opt_param_scheduler and continues
    # where it stopped (megatrain's full resume's rates), and Adam's moments travel in the torch_dist files.
    # (--override-opt_param-scheduler: a 6-iteration run's decay length against the 3-iteration run's, as Megatron)
    full = run_cmd([sys.executable, "pretrain_gpt.py", *MODEL, *RUN, "--train-iters", "6", "--load", str(first),
                    "--no-load-rng", "--override-opt_param-scheduler"], env=env)
    proc = run_cmd([sys.executable, "pretrain_gpt.py", *RUN, "--use-checkpoint-args", "--train-iters", "6",
                    "--load", str(dist), "--save", str(tmp_path / "resumed_schedule"),
                    "--override-opt_param-scheduler"], env=env)
    assert _logged(proc.stdout, "learning rate") == _logged(full.stdout, "learning rate")
    assert _logged(proc.stdout, "learning rate") != _logged(reference.stdout, "learning rate")
    assert _losses(proc.stdout) == _losses(full.stdout)
    assert "optimizer starts fresh" not in proc.stdout + proc.stderr
    # the legacy format with Adam's state (megatrain -> --saver megatron, TP=2 x PP=2): the same full resume
    legacy_adam = tmp_path / "megatron_legacy_adam"
    run_cmd(base + ["--loader", "megatrain", "--saver", "megatron", "--load-dir", str(first), "--save-dir",
                    str(legacy_adam), "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"],
            env=env)
    proc = run_cmd([sys.executable, "pretrain_gpt.py", *RUN, "--use-checkpoint-args", "--train-iters", "6",
                    "--load", str(legacy_adam), "--save", str(tmp_path / "resumed_legacy_adam"),
                    "--override-opt_param-scheduler"], env=env)
    assert _losses(proc.stdout) == _losses(full.stdout)
    assert _logged(proc.stdout, "learning rate") == _logged(full.stdout, "learning rate")
    assert "optimizer starts fresh" not in proc.stdout + proc.stderr


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
