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

    def reference():
        kr, vr = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
        mask = bias.masked_fill(~keep, float("-inf"))
        return F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)

    def ours():
        return attention_with_bias(q, k, v, biased_mask(bias, keep, q.dtype), bias)

    results = []
    for fn in (reference, ours):
        for t in (q, k, v, bias):
            t.grad = None
        out = fn()
        out.backward(grad_out)
        results.append([out.detach(), *(t.grad.clone() for t in (q, k, v, bias))])
    for name, want, got in zip(("out", "q", "k", "v", "bias"), *results):
        assert got.shape == want.shape, name
        rel = ((got - want).norm() / want.norm()).item()
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
    out = attention_with_bias(q, k, v, biased_mask(bias, keep, q.dtype), bias)
    BiasGrad = out.grad_fn
    assert "BiasGradient" in type(BiasGrad).__name__
    torch.autograd.backward(out, torch.randn_like(out), inputs=[bias])
    assert torch.isfinite(bias.grad).all()
