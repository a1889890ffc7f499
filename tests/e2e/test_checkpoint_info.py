"""`tools/checkpoint_info.py`: iteration, layout, parameter count, size on disk and arguments of a checkpoint."""

from __future__ import annotations

import argparse
import json
import sys

from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel
from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import TrainState
from megatrain.optimizer import OptimizerConfig, build_optimizer
from tests.e2e.conftest import run_cmd


def test_checkpoint_info_prints_iteration_layout_parameters_size_and_args(tmp_path):
    config = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, max_position_embeddings=8)
    model = GPTModel(config)
    model.init_weights(1)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3))
    args = argparse.Namespace(tensor_model_parallel_size=1, zero_stage=0, lr=1e-3, seq_length=8)
    for it in (5, 10):
        checkpointing.save_checkpoint(str(tmp_path), TrainState(iteration=it, consumed_train_samples=8 * it), model,
                                      opt, {}, args, config)
    proc = run_cmd([sys.executable, "tools/checkpoint_info.py", str(tmp_path)])
    out = proc.stdout
    assert "iteration:         10" in out and "consumed samples:  80" in out
    assert "model:             gpt, num_layers 1, hidden_size 16" in out and ", format 4)" in out
    assert "world 1 = tp 1 x pp 1 x cp 1 x dp 1 (ZeRO stage 0" in out
    assert f"parameters:        {model.num_parameters():,} in " in out
    assert "iterations 5, 10" in out and "  lr = 0.001" in out
    info = json.loads(run_cmd([sys.executable, "tools/checkpoint_info.py", str(tmp_path), "--ckpt-step", "5",
                               "--json", "--no-args"]).stdout)
    assert info["iteration"] == 5 and info["complete"] and info["parameters"] == model.num_parameters()
    assert info["family"] == "gpt" and info["format_version"] == 4
    size = sum(p.stat().st_size for p in (tmp_path / "iter_0000005").iterdir())
    assert info["size_bytes"] == size and "args" not in info
    bad = run_cmd([sys.executable, "tools/checkpoint_info.py", str(tmp_path / "nowhere")], check=False)
    assert bad.returncode != 0 and "no checkpoint found" in bad.stderr
