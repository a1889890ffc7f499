"""The bias gradient of attention_with_bias equals autograd's through SDPA with a trained mask."""

import pytest
import torch
import torch.nn.functional as F

from megatrain.models.common.bias_gradient import attention_with_bias, biased_mask


def _inputs(b=3, h=4, hkv=4, sq=24, sk=24, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g, dtype=torch.float64).float().requires_grad_()
    k = torch.randn(b, hkv, sk, d, generator=g).requires_grad_()
    v = torch.randn(b, hkv, sk, d, generator=g).requires_grad_()
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias_batch", [1, 3])
@pytest.mark.parametrize("hkv", [4, 2])
def test_gradients_equal_autograd_through_sdpa(causal, bias_batch, hkv):
    torch.manual_seed(0)
    b, h, s = 3, 4, 24
    q, k, v = _inputs(b=b, h=h, hkv=hkv, sq=s, sk=s)
    bias = torch.randn(bias_batch, h, s, s).requires_grad_()
    lengths = torch.tensor([24, 17, 9])
    keep = (torch.arange(s)[None, :] < lengths[:, None]).view(b, 1, 1, s)
    if causal:
        keep = keep & torch.ones(s, s, dtype=torch.bool).tril()
    grad_out = torch.randn(b, h, s, 16)

    # the reference in float64 (CPUs round float32 products differently; the exact value is the measure)
    q64, k64, v64, bias64 = (t.detach().double().requires_grad_() for t in (q, k, v, bias))

    def reference():
        kr, vr = (t.repeat_interleave(h // hkv, dim=1) for t in (k64, v64))
        mask = bias64.masked_fill(~keep, float("-inf"))
        out = F.scaled_dot_product_attention(q64, kr, vr, attn_mask=mask)
        out.backward(grad_out.double())
        return [out.detach(), *(t.grad for t in (q64, k64, v64, bias64))]

    def ours():
        out = attention_with_bias(q, k, v, biased_mask(bias, keep, q.dtype), bias, keep)
        out.backward(grad_out)
        return [out.detach(), *(t.grad for t in (q, k, v, bias))]

    for name, want, got in zip(("out", "q", "k", "v", "bias"), reference(), ours()):
        assert got.shape == want.shape, name
        rel = ((got.double() - want).norm() / want.norm()).item()
        assert rel < 1e-5, f"{name}: relative error {rel:.2e}"


def test_frozen_bias_and_no_grad_take_sdpa_alone():
    q, k, v = _inputs()
    bias = torch.randn(1, 4, 24, 24)
    out = attention_with_bias(q, k, v, biased_mask(bias, None, q.dtype), bias)
    assert out.grad_fn is not None and "BiasGradient" not in type(out.grad_fn).__name__
    with torch.no_grad():
        out2 = attention_with_bias(q, k, v, biased_mask(bias, None, q.dtype), bias.requires_grad_())
    assert out2.grad_fn is None and torch.allclose(out, out2)


def test_rows_with_every_key_hidden_give_finite_bias_gradient():
    q, k, v = _inputs(b=2)
    bias = torch.randn(1, 4, 24, 24, requires_grad=True)
    keep = torch.ones(2, 1, 24, 24, dtype=torch.bool)
    keep[1, :, 5] = False  # query 5 of sample 1 sees no key
    out = attention_with_bias(q, k, v, biased_mask(bias, keep, q.dtype), bias, keep)
    BiasGrad = out.grad_fn
    assert "BiasGradient" in type(BiasGrad).__name__
    torch.autograd.backward(out, torch.randn_like(out), inputs=[bias])
    assert torch.isfinite(bias.grad).all()


def _t5_step(bias_gradient: str, dtype=torch.float32, enc_len: int = 12, dec_len: int = 7, **overrides):
    from tests.unit.t5_tiny import random_model

    model = random_model(bias_gradient=bias_gradient, **overrides).to(dtype).train()
    g = torch.Generator().manual_seed(3)
    enc = torch.randint(5, 40, (3, enc_len), generator=g)
    dec = torch.randint(5, 40, (3, dec_len), generator=g)
    enc_pad = torch.ones(3, enc_len, dtype=torch.long)
    enc_pad[1, 9:] = 0
    dec_pad = torch.ones(3, dec_len, dtype=torch.long)
    dec_pad[2, 5:] = 0
    labels = torch.randint(5, 40, (3, dec_len), generator=g)
    torch.manual_seed(11)  # the attention dropout's draws
    loss = model(enc, dec, enc_pad, dec_pad, labels=labels).mean()
    loss.backward()
    return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_t5_recompute_gives_the_mask_paths_loss_and_gradients(dropout):
    """T5 with ``bias_gradient="recompute"`` (and its fallback under attention dropout) trains as the
    float mask with a gradient does: the same loss and gradients, both relative-bias tables included.
    The tables' gradients are sums with much cancellation (each row of score gradients sums to zero),
    so both float32 paths are held against float64: the recomputed one no further from it."""
    loss_a, grads_a = _t5_step("mask", attention_dropout=dropout)
    loss_b, grads_b = _t5_step("recompute", attention_dropout=dropout)
    _, grads_64 = _t5_step("mask", torch.float64, attention_dropout=dropout)
    assert torch.allclose(loss_a, loss_b, rtol=1e-6, atol=0)
    assert grads_a.keys() == grads_b.keys() == grads_64.keys()
    assert {"encoder_relative_pos_emb.relative_attention_bias.weight",
            "decoder_relative_pos_emb.relative_attention_bias.weight"} <= grads_a.keys()
    for name, want in grads_64.items():
        err_a, err_b = ((g[name] - want).norm() / want.norm().clamp_min(1e-30) for g in (grads_a, grads_b))
        assert err_b < max(1.5 * err_a, 1e-6) and err_b < 2e-4, f"{name}: {err_b:.2e} (mask path {err_a:.2e})"


def test_t5_bias_gradient_from_env(monkeypatch):
    from megatrain.models.t5.config import bias_gradient_from_env

    monkeypatch.delenv("MEGATRAIN_T5_BIAS_GRADIENT", raising=False)
    assert bias_gradient_from_env() == "auto"
    for value in ("mask", "recompute", "auto"):
        monkeypatch.setenv("MEGATRAIN_T5_BIAS_GRADIENT", value)
        assert bias_gradient_from_env() == value
    monkeypatch.setenv("MEGATRAIN_T5_BIAS_GRADIENT", "fast")
    with pytest.raises(ValueError, match="MEGATRAIN_T5_BIAS_GRADIENT must be auto, mask, recompute, got 'fast'"):
        bias_gradient_from_env()


def test_lse_tile_from_env(monkeypatch):
    from megatrain.models.common.bias_gradient_kernel import lse_tile_from_env

    monkeypatch.delenv("MEGATRAIN_BIAS_GRAD_LSE_TILE", raising=False)
    assert lse_tile_from_env() == (64, 64, 4)
    monkeypatch.setenv("MEGATRAIN_BIAS_GRAD_LSE_TILE", "128x64w8")
    assert lse_tile_from_env() == (128, 64, 8)
    for bad in ("128x64", "100x64w8", "8x64w4", "64x64w3", "64x64w32"):
        monkeypatch.setenv("MEGATRAIN_BIAS_GRAD_LSE_TILE", bad)
        with pytest.raises(ValueError, match=f"MEGATRAIN_BIAS_GRAD_LSE_TILE must be BMxBNwW .*got '{bad}'"):
            lse_tile_from_env()


def test_auto_recomputes_only_where_the_triton_kernel_runs_on_a_gpu():
    """"auto" picks the recomputation on CUDA with the Triton kernel, the mask's own gradient elsewhere
    (the PyTorch recomputation is slower than the mask's gradient); the two forced choices hold anywhere."""
    from megatrain.models.common.bias_gradient import BiasedMask
    from megatrain.models.common.bias_gradient_kernel import kernel_available
    from megatrain.models.t5.config import recomputes_bias_gradient
    from tests.unit.t5_tiny import random_model

    cpu = torch.device("cpu")
    assert not recomputes_bias_gradient("auto", cpu)
    assert recomputes_bias_gradient("recompute", cpu) and not recomputes_bias_gradient("mask", cpu)
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert recomputes_bias_gradient("auto", cuda) == kernel_available(cuda)
    # the model follows it: on the CPU "auto" hands the layers a float mask with a gradient, "recompute"
    # a BiasedMask
    for choice, biased in (("auto", False), ("recompute", True)):
        model = random_model(bias_gradient=choice).train()
        tokens = torch.randint(0, model.config.vocab_size, (2, 8))
        bias_table = model.encoder_relative_pos_emb
        mask = model._mask(bias_table, None, tokens, causal=False)
        assert isinstance(mask, BiasedMask) == biased, choice


KERNEL_CHECK = r"""
import torch, torch.nn.functional as F
import megatrain.models.common.bias_gradient as bg
from megatrain.models.common.bias_gradient import attention_with_bias, biased_mask, _kernel_applies
from megatrain.models.common.bias_gradient_kernel import attention_bias_grad
torch.manual_seed(0)
worst = 0.0
bg.SDPA_LOG_SUM_EXP = False  # SDPA, then BiasGradient (the kernel computes the log-sum-exp)
for b, h, hkv, m, n, d, causal in [(3, 4, 4, 70, 70, 16, False), (2, 4, 2, 40, 40, 32, True),
                                   (2, 2, 2, 64, 96, 24, False), (1, 2, 2, 130, 130, 64, True)]:
    q = torch.randn(b, h, m, d, requires_grad=True)
    k, v = (torch.randn(b, hkv, n, d, requires_grad=True) for _ in range(2))
    bias = torch.randn(1, h, m, n, requires_grad=True)
    lengths = torch.randint(n // 2, n + 1, (b,))
    keep = (torch.arange(n)[None, :] < lengths[:, None]).view(b, 1, 1, n)
    if causal:
        keep = keep & torch.ones(m, n, dtype=torch.bool).tril()
    if causal and b == 1:
        keep[0, 0, 5] = False  # a query that sees no key: probabilities 0, a finite gradient
    assert _kernel_applies(q, bias, keep)
    go = torch.randn(b, h, m, d)
    out = attention_with_bias(q, k, v, biased_mask(bias, keep, q.dtype), bias, keep)
    assert "BiasGradient" in type(out.grad_fn).__name__
    out.backward(go)
    got = bias.grad.clone()
    bias.grad = None
    # the references in float64: CPUs differ in how their float32 matmuls round, the kernel (numpy's
    # float32 products under the interpreter) is measured against the exact value instead
    kr, vr = (t.detach().double().repeat_interleave(h // hkv, 1) for t in (k, v))
    bias64 = bias.detach().double().requires_grad_()
    mask = bias64.masked_fill(~keep, float("-inf"))
    ref_out = F.scaled_dot_product_attention(q.detach().double(), kr, vr, attn_mask=mask)
    ref_out.backward(go.double())
    want = torch.nan_to_num(bias64.grad).float()
    ref_out = ref_out.detach().float()
    assert torch.isfinite(got).all()
    rel = ((got - want).norm() / want.norm()).item()
    worst = max(worst, rel)
    alone = attention_bias_grad(q.detach(), k.detach(), v.detach(), ref_out.detach(), go, bias.detach(), keep,
                                d ** -0.5)
    assert alone.shape == (h, m, n), alone.shape
    rel_alone = ((alone - got[0]).norm() / got.norm()).item()
    assert rel_alone < 1e-5, (b, h, m, n, rel_alone)
    # the batch shared among programs that add their sums atomically: the same gradient
    import megatrain.models.common.bias_gradient_kernel as bgk
    bgk.SPLIT_BATCH = 2
    split = attention_bias_grad(q.detach(), k.detach(), v.detach(), ref_out.detach(), go, bias.detach(), keep,
                                d ** -0.5)
    bgk.SPLIT_BATCH = 1
    rel_split = ((split - alone).norm() / alone.norm()).item()
    assert rel_split < 1e-6, (b, h, m, n, rel_split)
    # another log-sum-exp tile (rows and keys over two blocks, pipelined): the same gradient
    saved_lse = bgk.LSE_TILE, bgk.LSE_STAGES
    bgk.LSE_TILE, bgk.LSE_STAGES = (32, 16, 4), 2
    other_tile = attention_bias_grad(q.detach(), k.detach(), v.detach(), ref_out.detach(), go, bias.detach(), keep,
                                     d ** -0.5)
    bgk.LSE_TILE, bgk.LSE_STAGES = saved_lse
    rel_tile = ((other_tile - alone).norm() / alone.norm()).item()
    assert rel_tile < 1e-6, (b, h, m, n, rel_tile)
    # given the forward's log-sum-exp (as SDPA's memory-efficient kernel keeps it: rows padded to 32,
    # +inf where no key is seen) instead of computing it: the same gradient
    scores = (q.detach().double() @ kr.transpose(-1, -2)) * d ** -0.5 + mask.detach()
    lse = torch.full((b, h, -(-m // 32) * 32), float("nan"))
    lse[:, :, :m] = torch.logsumexp(scores, -1).float().nan_to_num(posinf=float("inf"), neginf=float("inf"))
    given = attention_bias_grad(q.detach(), k.detach(), v.detach(), ref_out, go, bias.detach(), keep,
                                d ** -0.5, lse)
    rel_given = ((given - alone).norm() / alone.norm()).item()
    assert rel_given < 1e-5, (b, h, m, n, rel_given)
assert worst < 1e-5, worst
# the forward's log-sum-exp kept (AttentionWithLogSumExp; on the CPU through its flash-style kernel): SDPA's
# output and q, k, v gradients, autograd's bias gradient
bg.SDPA_LOG_SUM_EXP = True
for b, h, hkv, m, n, d, causal in [(3, 4, 4, 40, 48, 16, False), (2, 4, 2, 64, 64, 32, True)]:
    q = torch.randn(b, h, m, d, requires_grad=True)
    k, v = (torch.randn(b, hkv, n, d, requires_grad=True) for _ in range(2))
    bias = torch.randn(1, h, m, n, requires_grad=True)
    keep = (torch.arange(n)[None, :] < torch.randint(n // 2, n + 1, (b,))[:, None]).view(b, 1, 1, n)
    if causal:
        keep = keep & torch.ones(m, n, dtype=torch.bool).tril()
    mask = biased_mask(bias.detach(), keep, q.dtype)
    go = torch.randn(b, h, m, d)
    out = attention_with_bias(q, k, v, mask, bias, keep)
    assert type(out.grad_fn).__name__.startswith("AttentionWithLogSumExp"), type(out.grad_fn)
    out.backward(go)
    got = [t.grad.clone() for t in (q, k, v, bias)]
    for t in (q, k, v, bias):
        t.grad = None
    kr, vr = (t.repeat_interleave(h // hkv, 1) for t in (k, v))
    ref = F.scaled_dot_product_attention(q, kr, vr, attn_mask=bias.masked_fill(~keep, float("-inf")))
    ref.backward(go)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    for name, g, t in zip("qkvb", got, (q, k, v, bias)):
        rel = ((g - torch.nan_to_num(t.grad)).norm() / t.grad.nan_to_num().norm()).item()
        assert rel < 1e-5, (name, rel)
# T5 end to end (encoder padding; decoder causality and padding): the kernel's gradients as the mask's
from tests.unit.test_bias_gradient import _t5_step
(la, ga), (lb, gb) = _t5_step("mask"), _t5_step("recompute")
assert torch.allclose(la, lb, rtol=1e-6, atol=0)
for name in ("encoder_relative_pos_emb.relative_attention_bias.weight",
             "decoder_relative_pos_emb.relative_attention_bias.weight"):
    assert ((gb[name] - ga[name]).norm() / ga[name].norm()).item() < 1e-4, name
# T5 at lengths of 16, where the model's self-attentions keep SDPA's log-sum-exp (AttentionWithLogSumExp)
calls = []
forward = bg.AttentionWithLogSumExp.forward
bg.AttentionWithLogSumExp.forward = staticmethod(lambda *a: calls.append(1) or forward(*a))
(la, ga), (lb, gb) = _t5_step("mask", enc_len=16, dec_len=16), _t5_step("recompute", enc_len=16, dec_len=16)
assert len(calls) == 5, len(calls)  # 2 encoder + 3 decoder self-attentions
assert torch.allclose(la, lb, rtol=1e-6, atol=0)
assert ga.keys() == gb.keys()
for name in ga:  # every parameter (float32 SDPA kernels that differ: ~1e-5 apart through the random model)
    assert ((gb[name] - ga[name]).norm() / ga[name].norm()).item() < 1e-4, name
print("kernel ok", worst)
"""


def test_triton_kernel_under_the_interpreter_equals_autograd():
    """The Triton kernel of the bias gradient (bias_gradient_kernel), run by Triton's interpreter on
    the CPU (TRITON_INTERPRET=1 must be set before Triton is imported: a fresh process): the gradient
    of SDPA's float mask within 1e-5, with padding, causality, grouped keys, lengths that are not
    multiples of the tiles and a query that sees no key."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    triton = pytest.importorskip("triton", reason="make env installs Triton for these tests")
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"Triton {triton.__version__}'s interpreter predates numpy 2 support (3.9)")
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK], cwd=repo, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo)})
    assert proc.returncode == 0 and "kernel ok" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,compiled", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_triton_kernel_on_cuda_equals_the_pytorch_recomputation(dtype, compiled):
    """On CUDA the kernel computes the bias gradient (T5-base's encoder shape, cut to 8 samples); the
    same as the PyTorch recomputation in float64, eager and inside torch.compile."""
    from megatrain.models.common import bias_gradient as bg

    dev = torch.device("cuda")
    torch.manual_seed(0)
    b, h, s, d = 8, 12, 512, 64
    q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(3))
    bias = torch.randn(1, h, s, s, device=dev, requires_grad=True)
    lengths = torch.randint(s // 2, s + 1, (b,), device=dev)
    keep = (torch.arange(s, device=dev)[None, :] < lengths[:, None]).view(b, 1, 1, s)
    assert bg._kernel_applies(q, bias, keep)

    def step(q, k, v, bias):
        return attention_with_bias(q, k, v, biased_mask(bias, keep, q.dtype), bias, keep)

    fn = torch.compile(step, fullgraph=True) if compiled else step
    out = fn(q, k, v, bias)
    go = torch.randn_like(out)
    out.backward(go)
    got = bias.grad.clone()
    # the reference: the PyTorch path of BiasGradient.backward in float64 on the same output
    scores = (q.double() @ k.double().transpose(-1, -2)) * d ** -0.5 + bias.detach().double()
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    dp = go.double() @ v.double().transpose(-1, -2)
    want = (probs * (dp - (go.double() * out.detach().double()).sum(-1, keepdim=True))).sum(0, keepdim=True)
    rel = ((got.double() - want).norm() / want.norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 2e-2), rel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,compiled,causal", [(torch.float32, False, False), (torch.bfloat16, False, False),
                                                   (torch.bfloat16, True, False), (torch.bfloat16, True, True)])
def test_sdpa_log_sum_exp_path_gives_sdpas_gradients(dtype, compiled, causal, monkeypatch):
    """On CUDA the trained bias's attention runs SDPA's memory-efficient kernel directly and hands its
    log-sum-exp to the bias-gradient kernel (AttentionWithLogSumExp): the output and the q, k, v
    gradients are SDPA's on the detached mask, the bias gradient the float64 recomputation's, eager and
    inside torch.compile, for T5's encoder (key padding) and decoder (causal and padding) masks."""
    from megatrain.models.common import bias_gradient as bg

    monkeypatch.setattr(bg, "SDPA_LOG_SUM_EXP", True)  # off by default (slower than cuDNN's attention)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    b, h, s, d = (8, 12, 512, 64) if not causal else (8, 12, 128, 64)
    q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(3))
    bias = torch.randn(1, h, s, s, device=dev, requires_grad=True)
    lengths = torch.randint(s // 2, s + 1, (b,), device=dev)
    keep = (torch.arange(s, device=dev)[None, :] < lengths[:, None]).view(b, 1, 1, s)
    if causal:
        keep = keep & torch.ones(s, s, dtype=torch.bool, device=dev).tril()
    mask = biased_mask(bias.detach(), keep, dtype)
    assert bg._lse_path_applies(q, k, v, mask, bias, keep)

    def step(q, k, v, bias):
        return attention_with_bias(q, k, v, mask, bias, keep)

    out = (torch.compile(step, fullgraph=True) if compiled else step)(q, k, v, bias)
    if not compiled:
        assert type(out.grad_fn).__name__.startswith("AttentionWithLogSumExp")
    go = torch.randn_like(out)
    out.backward(go)
    got = [t.grad.clone() for t in (q, k, v)]
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask)
    ref.backward(go)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((out.detach().float() - ref.float()).norm() / ref.float().norm()).item() < tol
    for name, g, r in zip("qkv", got, (q2.grad, k2.grad, v2.grad)):
        assert ((g.float() - r.float()).norm() / r.float().norm()).item() < tol, name
    scores = (q.double() @ k.double().transpose(-1, -2)) * d ** -0.5 + mask.double()
    probs = torch.softmax(scores, dim=-1)
    dp = go.double() @ v.double().transpose(-1, -2)
    want = (probs * (dp - (go.double() * out.detach().double()).sum(-1, keepdim=True))).sum(0, keepdim=True)
    rel = ((bias.grad.double() - want).norm() / want.norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 2e-2), rel


def test_the_kernel_benchmark_runs_every_setting_to_the_same_gradient():
    """benchmarks/bias_gradient_kernel.py under the interpreter: tiles, batch splits (atomic adds) and
    pipelining stages give the first setting's gradient (a row saying "differs" otherwise)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    triton = pytest.importorskip("triton", reason="make env installs Triton for these tests")
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"Triton {triton.__version__}'s interpreter predates numpy 2 support (3.9)")
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "benchmarks/bias_gradient_kernel.py", "--shape", "tiny", "--settings",
                           "16x16-w4", "16x16-w4-s2", "32x16-w4-p2"], cwd=repo, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ran (interpreter)") == 3 and "differs" not in proc.stdout, proc.stdout
