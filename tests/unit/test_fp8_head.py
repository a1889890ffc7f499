"""The output layer in fp8 (``MEGATRAIN_FP8_OUTPUT_LAYER=1``, megatrain.runtime.fp8_head): the chunked loss
head's matmuls against the recipe's maths in float32 (e4m3 hidden states and weight, the logits' gradient in
the gradient dtype, float32 weight gradients accumulated over micro-batches), padded rows and ignored labels,
the setting, and a run through pretrain_gpt.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatrain.runtime.fp8_fusion import E4M3, E5M2, quantize
from megatrain.runtime.fp8_head import Fp8HeadWeights
from megatrain.runtime.fused_loss import ChunkedCrossEntropy
from megatrain.runtime.grad_accumulation_fusion import GradAccumulationFusion
from megatrain.training.run_config import fp8_output_layer_from_env
from tests.unit.test_fp8_fusion import _run  # noqa: F401  (skips this module where the CPU has no fp8 matmul)

V, H = 96, 64


def _head(grad_dtype: torch.dtype = E5M2, shape: tuple[int, int] = (V, H), device: str = "cpu", chunk: int = 8):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(*shape, device=device) * 0.05)
    head = ChunkedCrossEntropy(chunk_size=chunk)
    head.fp8_weights = Fp8HeadWeights(grad_dtype, compile_cast=False)
    fusion = GradAccumulationFusion([], torch.bfloat16, extra=[(head, weight)])
    return head, weight, fusion


def _reference(weight, hs, targets, grad_dtype):
    """The recipe in float32, each micro-batch's loss summed (its gradient 1 per token)."""
    V = weight.shape[0]
    w8, w_inv = quantize(weight.detach(), E4M3)
    losses, grads_h, grad_w = [], [], torch.zeros_like(weight)
    for h, t in zip(hs, targets):
        h8, h_inv = quantize(h.to(torch.bfloat16), E4M3)
        logits = ((h8.float() @ w8.float().t()) * h_inv * w_inv).to(torch.bfloat16).float()
        losses.append(F.cross_entropy(logits, t, reduction="none", ignore_index=-100))
        g = torch.softmax(logits, -1) - F.one_hot(t.clamp(min=0), V).float()
        g = torch.where((t != -100)[:, None], g, torch.zeros_like(g)).to(torch.bfloat16)
        g8, g_inv = quantize(g, grad_dtype)
        grads_h.append(((g8.float() @ w8.float()) * g_inv * w_inv).to(torch.bfloat16).float())
        grad_w += (g8.float().t() @ h8.float()) * g_inv * h_inv
    return losses, grads_h, grad_w


@pytest.mark.parametrize("grad_dtype", [E5M2, E4M3], ids=["hybrid", "e4m3"])
@pytest.mark.parametrize("rows", [48, 37], ids=["rows_multiple_of_16", "padded_rows"])
def test_matmuls_follow_the_recipe_and_the_weight_gradient_accumulates(grad_dtype, rows):
    head, weight, fusion = _head(grad_dtype)
    _check_two_micro_batches(head, weight, fusion, grad_dtype, rows, "cpu")


def _check_two_micro_batches(head, weight, fusion, grad_dtype, rows, device, call=None):
    """Two micro-batches (the second with ignored labels) through ``call`` (the head, or its compiled
    self), against the recipe in float32."""
    V, H = weight.shape
    gen = torch.Generator(device).manual_seed(1)
    hs = [torch.randn(rows, H, generator=gen, device=device) * s for s in (1.0, 3.0)]
    targets = [torch.randint(0, V, (rows,), generator=gen, device=device) for _ in hs]
    targets[1][::5] = -100  # ignored labels: loss 0, no gradient
    fusion.refresh()
    losses, grads_h = [], []
    for h, t in zip(hs, targets):
        h = h.clone().requires_grad_(True)
        fusion.stage()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = (call or head)(h, weight, t)
        fusion.release()
        loss.sum().backward()
        fusion.merge_held()
        losses.append(loss.detach())
        grads_h.append(h.grad.float())
    want_loss, want_gh, want_gw = _reference(weight, hs, targets, grad_dtype)
    for got, want in zip(losses, want_loss):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert (got[targets[1] == -100] == 0).all() if got is losses[1] else True
    for got, want in zip(grads_h, want_gh):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2 * want.abs().max().item())
    assert weight.grad.dtype == torch.float32
    torch.testing.assert_close(weight.grad, want_gw, rtol=5e-2, atol=5e-2 * want_gw.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with fp8 matmuls (sm89 or later)")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_head_follows_the_recipe(compiled):
    """On the GPU's fp8 kernels (``torch._scaled_mm``), eager and inside ``torch.compile``: the losses, the
    hidden states' gradients and the float32 weight gradient accumulated over two micro-batches follow the
    recipe in float32 (rows not a multiple of 16, a vocabulary of several chunks)."""
    head, weight, fusion = _head(E5M2, shape=(1024, 256), device="cuda", chunk=128)
    call = torch.compile(head) if compiled else None
    _check_two_micro_batches(head, weight, fusion, E5M2, 300, "cuda", call)


def test_before_the_first_refresh_the_head_runs_in_bf16():
    head, weight, _ = _head()
    h = torch.randn(16, H)
    t = torch.randint(0, V, (16,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = head(h, weight, t)
    want = F.cross_entropy((h.bfloat16() @ weight.detach().bfloat16().t()).float(), t, reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_the_setting(monkeypatch):
    monkeypatch.delenv("MEGATRAIN_FP8_OUTPUT_LAYER", raising=False)
    assert fp8_output_layer_from_env() is False
    monkeypatch.setenv("MEGATRAIN_FP8_OUTPUT_LAYER", "1")
    assert fp8_output_layer_from_env() is True
    monkeypatch.setenv("MEGATRAIN_FP8_OUTPUT_LAYER", "yes")
    with pytest.raises(ValueError, match="MEGATRAIN_FP8_OUTPUT_LAYER must be 0 or 1, got 'yes'"):
        fp8_output_layer_from_env()


FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--num-workers", "0", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
         "--eval-iters", "0", "--device", "cpu", "--lr", "3e-3", "--train-iters", "3", "--log-interval", "1",
         "--bf16", "--fp8-format", "hybrid", "--no-torch-compile", "--cross-entropy-chunk-size", "64",
         "--hidden-dropout", "0", "--attention-dropout", "0"]


def _pretrain(value: str) -> subprocess.CompletedProcess:
    repo = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "pretrain_gpt.py", *FLAGS], cwd=repo, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "MEGATRAIN_FP8_OUTPUT_LAYER": value})


def _losses(proc: subprocess.CompletedProcess) -> list[float]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [float(line.split("lm loss: ")[1].split()[0]) for line in proc.stdout.splitlines() if "] iteration " in line]


@pytest.mark.slow
def test_pretrain_gpt_says_it_runs_the_output_layer_in_fp8_and_refuses_a_bad_setting():
    pytest.importorskip("torchao.float8")
    proc = _pretrain("1")
    assert "the output layer too (MEGATRAIN_FP8_OUTPUT_LAYER=1" in proc.stdout, proc.stdout[-3000:]
    assert len(_losses(proc)) == 3
    bad = _pretrain("yes")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "MEGATRAIN_FP8_OUTPUT_LAYER must be 0 or 1, got 'yes'" in bad.stderr + bad.stdout


@pytest.mark.slow
@pytest.mark.long
def test_pretrain_gpt_with_the_fp8_output_layer_follows_the_bf16_head():
    """Three iterations: the losses follow the same fp8 run with its output layer in bf16."""
    pytest.importorskip("torchao.float8")
    plain = _pretrain("0")
    assert "the output layer stays bf16" in plain.stdout
    bf16_head, fp8_head = _losses(plain), _losses(_pretrain("1"))
    for a, b in zip(bf16_head, fp8_head):
        assert abs(a - b) <= 2e-3 * abs(a), (bf16_head, fp8_head)
