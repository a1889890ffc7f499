"""A step whose gradients overflow is skipped: weights, optimizer state and schedule unchanged.

On CUDA with fused optimizer kernels the step is queued before the host reads the overflow flag and
skips itself on the device; elsewhere the host decides first. Both must behave the same.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatrain.training.arguments import parse_args
from megatrain.training.trainer import Trainer

ARGS = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--num-workers", "0", "--lr", "1e-2", "--lr-warmup-iters", "0", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--log-interval", "100", "--eval-iters", "0",
        "--train-iters", "4", "--fp16", "--no-torch-compile"]

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="needs CUDA")])]


def _state(t: Trainer) -> tuple[dict, list]:
    weights = {k: v.detach().clone() for k, v in t.module.state_dict().items()}
    steps = [float(s["step"]) for s in t.optimizer.state.values() if "step" in s]
    return weights, steps


@pytest.mark.parametrize("fused", [False, True], ids=["host_decides", "fused_kernels_skip"])
@pytest.mark.parametrize("device", DEVICES)
def test_an_overflowing_step_changes_nothing_and_the_next_one_trains(device, fused):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    t = Trainer(parse_args([*ARGS, "--device", device, "--initial-loss-scale", "1e30",
                                 "--hysteresis", "1"]))  # fp16 grads overflow
    try:
        assert t.device.type == device
        if fused != bool(t.optimizer.defaults.get("fused")):  # the other kernel choice (fused exists on CPU too)
            for group in [t.optimizer.defaults, *t.optimizer.param_groups]:
                group["fused"], group["foreach"] = fused, not fused
        lr_before = t.scheduler.current_lr()
        weights, steps = _state(t)
        result = t.train_step()
        assert result.skipped and result.grad_norm is None
        after, steps_after = _state(t)
        assert all(torch.equal(v, after[k]) for k, v in weights.items()), "a skipped step changed the weights"
        assert all(step == 0.0 for step in steps_after) and not steps  # states may exist, without a step
        assert t.scheduler.current_lr() == lr_before
        assert t.scaler.scale < 1e30  # backed off
        t.scaler._scale = 1024.0  # representable: the next step trains
        result = t.train_step()
        assert not result.skipped and result.grad_norm is not None and result.grad_norm > 0
        after, _ = _state(t)
        assert any(not torch.equal(v, after[k]) for k, v in weights.items())
        assert all(float(s["step"]) == 1.0 for s in t.optimizer.state.values())
    finally:
        t.close()
