"""`pretrain_gpt.py` with Megatron's fp8 example settings (``--fp8-amax-history-len``,
``--fp8-amax-compute-algo max``: delayed scaling) on one CPU process: the start-up line names the
recipe, the amax histories travel in the checkpoint's meta.json, and a resumed run continues with
the same losses; without the saved histories it would not (so the check is not vacuous)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from megatrain.checkpoint.integrity import marker_text
from megatrain.training.logging import parse_train_log_line
from tests.e2e.conftest import cpu_env, run_cmd

pytestmark = pytest.mark.slow

RUN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--max-position-embeddings", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
       "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--mock-data",
       "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--eval-iters", "0", "--device", "cpu",
       "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "4", "--log-interval", "1", "--seed", "5",
       "--no-torch-compile", "--bf16", "--fp8-format", "hybrid",
       "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]


def _losses(stdout: str) -> list[tuple[int, float, float]]:
    lines = [parse_train_log_line(line) for line in stdout.splitlines() if "] iteration " in line]
    return [(d["iteration"], d["lm loss"], d["grad norm"]) for d in lines]


def test_delayed_scaling_resumes_exactly_from_its_checkpointed_histories(tmp_path):
    pytest.importorskip("torchao.float8")  # (require_fp8 asks for it at start-up)
    save = tmp_path / "ckpt"
    full = run_cmd([sys.executable, "pretrain_gpt.py", *RUN, "--save", str(save), "--save-interval", "2"],
                   env=cpu_env())
    assert any(" fp8 (hybrid" in line and "delayed scaling (amax history 4, max, margin 0)" in line
               for line in full.stdout.splitlines()), full.stdout[-3000:]
    straight = _losses(full.stdout)
    assert [i for i, _, _ in straight] == list(range(1, 5))
    meta = json.loads((save / "iter_0000002" / "meta.json").read_text())
    layers = meta["fp8_scaling"]["layers"]
    assert meta["fp8_scaling"]["recipe"]["history_len"] == 4
    assert len(layers) == 2 * 4  # QKV, attention output, fc1, fc2 of each layer
    qkv = layers["layers.0.self_attention.linear_qkv"]["input"]
    assert len(qkv) == 5 and qkv[0] != 1.0 and all(v > 0 for v in qkv[1:]), qkv  # 4 casts so far (2 steps x 2 micro-batches): all filled

    info = run_cmd([sys.executable, "tools/checkpoint_info.py", str(save), "--no-args"], env=cpu_env()).stdout
    assert "fp8 scaling:       delayed (amax history 4, max, margin 0), 8 layers, scales " in info, info

    resumed = run_cmd([sys.executable, "pretrain_gpt.py", *RUN, "--load", str(save), "--ckpt-step", "2"],
                      env=cpu_env())
    assert _losses(resumed.stdout) == straight[2:]

    # the same checkpoint without its histories: the scales restart at 1.0 and the losses move
    bare = tmp_path / "bare"
    shutil.copytree(save / "iter_0000002", bare / "iter_0000002")
    meta.pop("fp8_scaling")
    (bare / "iter_0000002" / "meta.json").write_text(json.dumps(meta))
    marker = json.loads((bare / "iter_0000002" / "complete_rank00000.json").read_text())  # sealed anew
    (bare / "iter_0000002" / "complete_rank00000.json").write_text(
        marker_text(str(bare / "iter_0000002"), 0, 1, 2, marker["files"]))
    (bare / "latest_checkpointed_iteration.txt").write_text("2")
    restarted = run_cmd([sys.executable, "pretrain_gpt.py", *RUN, "--load", str(bare), "--ckpt-step", "2"],
                        env=cpu_env())
    assert "holds no fp8 scaling state" in restarted.stdout
    assert _losses(restarted.stdout) != straight[2:]
