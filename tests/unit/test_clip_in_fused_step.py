"""Gradient clipping folded into a fused optimizer step: torch's fused Adam/AdamW/SGD divide the
gradients by ``optimizer.grad_scale`` as they read them, so the trainer hands them the clipping divisor
instead of scaling every gradient in a pass of its own. The weights must be those of clipping first."""

from __future__ import annotations

import os

import pytest
import torch

from megatrain.optimizer import clip_divisor, folds_grad_divisor
from megatrain.parallel.grad_norm import clip_coefficient
from megatrain.training import step as step_module
from megatrain.training.arguments import parse_args
from megatrain.training.trainer import Trainer

ARGS = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--num-workers", "0", "--lr", "1e-2", "--lr-warmup-iters", "0", "--mock-data", "--device", "cpu",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--log-interval", "100", "--eval-iters", "0",
        "--train-iters", "4", "--no-torch-compile"]


def _train(fold: bool, clip: str, optimizer: str, monkeypatch) -> tuple[dict, list[float], list[bool]]:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    asked: list[bool] = []

    def folds(opt, params):
        asked.append(folds_grad_divisor(opt, params))
        return fold and asked[-1]

    monkeypatch.setattr(step_module, "folds_grad_divisor", folds)
    t = Trainer(parse_args([*ARGS, "--clip-grad", clip, "--optimizer", optimizer]))
    try:
        for group in [t.optimizer.defaults, *t.optimizer.param_groups]:  # fused kernels exist on the CPU too
            group["fused"], group["foreach"] = True, False
        norms = [t.train_step().grad_norm for _ in range(3)]
        t.settle()
        return {k: v.detach().clone() for k, v in t.module.state_dict().items()}, norms, asked
    finally:
        t.close()


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("clip", ["0.05", "1000"], ids=["clipping", "under_the_limit"])
def test_fused_step_with_the_clipping_divisor_equals_clipping_first(clip, optimizer, monkeypatch):
    weights, norms, asked = _train(True, clip, optimizer, monkeypatch)
    reference, reference_norms, _ = _train(False, clip, optimizer, monkeypatch)  # the same kernels, clipped first
    assert asked == [True] * 3
    assert norms == pytest.approx(reference_norms, rel=1e-5)
    if clip == "0.05":
        assert min(norms) > 0.05  # the limit bit at every step
    for name, ref in reference.items():
        torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6, msg=name)


def test_divisor_is_the_inverse_of_the_coefficient():
    for norm in (0.0, 0.3, 1.0, 7.5, float("inf")):
        n = torch.tensor(norm)
        coef, div = clip_coefficient(1.0, n), clip_divisor(1.0, n)
        assert float(div) >= 1.0 and float(coef) <= 1.0
        if norm != float("inf"):
            assert float(coef * div) == pytest.approx(1.0, rel=1e-6)
    assert torch.isnan(clip_divisor(1.0, torch.tensor(float("nan"))))  # a nan norm: found_inf skips the step


def test_only_torch_fused_kernels_over_plain_tensors_fold():
    p = torch.nn.Parameter(torch.ones(3))
    assert folds_grad_divisor(torch.optim.AdamW([p], fused=True), [p])
    assert not folds_grad_divisor(torch.optim.AdamW([p], foreach=True), [p])
    assert not folds_grad_divisor(torch.optim.RMSprop([p]), [p])
