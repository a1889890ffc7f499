"""--log-params-norm and --log-num-zeros-in-grad (Megatron-LM's logging flags): each iteration's result
carries the L2 norm of the trained weights after its step and the count of zero gradient elements, equal to
those computed directly; the log line prints them where Megatron's does."""

from __future__ import annotations

import os

import pytest
import torch

from megatrain.training.arguments import parse_args
from megatrain.training.logging import parse_train_log_line
from megatrain.training.trainer import Trainer

ARGS = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--num-workers", "0", "--lr", "1e-2", "--lr-warmup-iters", "0", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "64", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "3",
        "--no-torch-compile", "--untie-embeddings-and-output-weights", "--device", "cpu"]


@pytest.mark.parametrize("extra", [[], ["--bf16"]], ids=["fp32", "bf16_fused_grads"])
def test_the_results_carry_the_weights_norm_and_the_gradients_zeros(extra):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    t = Trainer(parse_args([*ARGS, *extra, "--log-params-norm", "--log-num-zeros-in-grad"]))
    try:
        result = t.train_step()
        params = [p for p in t.module.parameters() if p.requires_grad]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach().float()) for p in params]))
        assert result.params_norm == pytest.approx(norm.item(), rel=1e-6)
        # the step's gradients are still there (zeroed at the next step): the untied embedding's rows of
        # the 60-odd ids the 16 tokens did not use are zero
        zeros = sum(int((p.grad == 0).sum()) for p in params if p.grad is not None)
        assert result.num_zeros == zeros and zeros >= 16 * (64 - 16)
        before = result.params_norm
        assert t.train_step().params_norm != before  # the weights moved
    finally:
        t.close()


def test_without_the_flags_nothing_is_measured():
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    t = Trainer(parse_args(ARGS))
    try:
        result = t.train_step()
        assert result.params_norm is None and result.num_zeros is None
    finally:
        t.close()


def test_the_log_line_prints_them_after_the_grad_norm(capsys):
    from megatrain.training.logging import format_train_log_line

    line = format_train_log_line(iteration=1, train_iters=2, consumed_samples=4, elapsed_ms=1.0, learning_rate=1e-3,
                                 global_batch_size=4, losses={"lm loss": 2.0}, grad_norm=1.5, num_zeros=1234,
                                 params_norm=19.0)
    assert "| grad norm: 1.500 | num zeros: 1234 | params norm: 19.000 | number of skipped" in line
    parsed = parse_train_log_line(line)
    assert parsed["num zeros"] == 1234 and parsed["params norm"] == 19.0
