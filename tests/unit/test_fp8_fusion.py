"""megatrain's fp8 layers on the gradient-accumulation fusion's protocol (MEGATRAIN_FP8_BACKEND=fused, the default):
the matmuls against the recipe's maths in float32, the weights cast once per step into fixed buffers,
the conversion inside parallelize_model, and the backend's setting. (tests/distributed's
``dp2_ddp_fp8_fused_hybrid`` and ``one_process_fp8_fused_e4m3`` check whole runs against torchao's layers.)"""

from __future__ import annotations

import pytest
import torch

from megatrain.runtime.fp8_fusion import E4M3, E5M2, Fp8FusedLinear, convert_fp8_linears, quantize
from megatrain.runtime.grad_accumulation_fusion import FusedGradLinear, GradAccumulationFusion

if not hasattr(torch, "_scaled_mm"):
    pytest.skip("this torch has no fp8 matmul", allow_module_level=True)
try:
    torch._scaled_mm(torch.zeros(16, 16, dtype=E4M3), torch.zeros(16, 16, dtype=E4M3).t(), torch.tensor(1.0),
                     torch.tensor(1.0), out_dtype=torch.float32)
except (RuntimeError, NotImplementedError):
    pytest.skip("this torch has no fp8 matmul on the CPU", allow_module_level=True)


def _layer(bias: bool, fmt: str = "hybrid", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(64, 48, bias=bias)
    with torch.no_grad():
        if bias:
            lin.bias.normal_()
    plain = torch.nn.Linear(64, 48, bias=bias)
    plain.load_state_dict(lin.state_dict())
    convert_fp8_linears([lin], fmt, dtype)
    return lin, plain, GradAccumulationFusion([], dtype, fp8_linears=[lin])


def _expected(plain: torch.nn.Linear, xs: list[torch.Tensor], grad_dtype: torch.dtype, dtype: torch.dtype,
              outputs: list[torch.Tensor] | None = None):
    """The recipe in float32: operands quantized per tensor, products of the fp8 values times both
    inverse scales; outputs rounded to ``dtype``; the weight gradient summed over micro-batches in float32.
    ``outputs``: the layer's own outputs, to take the gradients from (a last-bit difference in an
    output can flip an e5m2 rounding of its gradient, a 25 % step)."""
    w8, w_inv = quantize(plain.weight.detach(), E4M3)
    ys, gxs, gw, gb = [], [], torch.zeros_like(plain.weight), None
    for i, x in enumerate(xs):
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        x8, x_inv = quantize(x2, E4M3)
        y = ((x8.float() @ w8.float().t()) * x_inv * w_inv).to(dtype)
        if plain.bias is not None:
            y = y + plain.bias.detach().to(dtype)
        g = (2 * (y if outputs is None else outputs[i]).float()).to(dtype)  # d/dy of sum(y^2)
        g8, g_inv = quantize(g, grad_dtype)
        gxs.append(((g8.float() @ w8.float()) * g_inv * w_inv).to(dtype).float())
        gw += (g8.float().t() @ x8.float()) * g_inv * x_inv
        if plain.bias is not None:
            gb = g.float().sum(0) + (0 if gb is None else gb)
        ys.append(y.float())
    return ys, gxs, gw, gb


def _run(lin, fusion, xs: list[torch.Tensor], fresh: bool = False):
    fusion.refresh()
    ys, gxs = [], []
    for x in xs:
        x = x.clone().requires_grad_(True)
        fusion.stage(fresh=fresh)
        y = lin(x)
        fusion.release()
        y.float().pow(2).sum().backward()
        fusion.merge_held()
        ys.append(y.detach().reshape(-1, y.shape[-1]).float())
        gxs.append(x.grad.reshape(-1, x.shape[-1]).float())
    return ys, gxs


@pytest.mark.parametrize("fmt, grad_dtype", [("hybrid", E5M2), ("e4m3", E4M3)])
@pytest.mark.parametrize("rows", [48, 40], ids=["tokens_multiple_of_16", "padded_tokens"])
@pytest.mark.parametrize("bias", [False, True])
def test_matmuls_follow_the_recipe_and_gradients_accumulate_in_float32(fmt, grad_dtype, rows, bias):
    lin, plain, fusion = _layer(bias, fmt)
    xs = [torch.randn(2, rows // 2, 64) * s for s in (1.0, 3.0, 0.2)]  # three micro-batches, other scales
    ys, gxs = _run(lin, fusion, xs)
    want_y, want_gx, want_gw, want_gb = _expected(plain, xs, grad_dtype, torch.bfloat16, ys)
    for got, want in zip(ys + gxs, want_y + want_gx):
        # bf16 outputs: the kernels may sum in another order (fast accumulation in the forward)
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item())
    assert lin.weight.grad.dtype == torch.float32
    torch.testing.assert_close(lin.weight.grad, want_gw, rtol=1e-5, atol=1e-5 * want_gw.abs().max().item())
    if bias:
        torch.testing.assert_close(lin.bias.grad, want_gb, rtol=2e-2, atol=2e-2 * want_gb.abs().max().item())


def test_one_micro_batch_writes_new_float32_gradients():
    lin, plain, fusion = _layer(False)
    x = torch.randn(2, 16, 64)
    _run(lin, fusion, [x], fresh=True)
    *_, want_gw, _ = _expected(plain, [x], E5M2, torch.bfloat16)
    torch.testing.assert_close(lin.weight.grad, want_gw, rtol=1e-5, atol=1e-6)


def test_weights_are_cast_once_per_refresh_into_the_same_buffers():
    lin, _, fusion = _layer(False)
    assert lin.fp8_weight is None  # before the first refresh: a plain linear layer
    x = torch.randn(4, 64)
    torch.testing.assert_close(lin(x), x @ lin.weight.t() + 0)
    fusion.refresh()
    buffers = (lin.fp8_weight, lin.fp8_weight_t, lin.fp8_inv_scale)
    w8, inv = quantize(lin.weight.detach(), E4M3)
    assert torch.equal(lin.fp8_weight.view(torch.uint8), w8.view(torch.uint8))
    assert torch.equal(lin.fp8_weight_t.view(torch.uint8), w8.t().contiguous().view(torch.uint8))
    assert lin.fp8_inv_scale.item() == inv.item()
    with torch.no_grad():
        lin.weight.mul_(3.0)  # an optimizer step
    fusion.refresh()
    assert all(a is b for a, b in zip(buffers, (lin.fp8_weight, lin.fp8_weight_t, lin.fp8_inv_scale))), \
        "refresh must write in place (captured CUDA graphs read these buffers)"
    assert lin.fp8_inv_scale.item() == pytest.approx(3 * inv.item(), rel=1e-6)
    fusion.drop_half_weights()
    assert lin.fp8_weight is None


def test_compiled_layer_equals_eager():
    """Inductor traces the layer (its autograd function, the in-place accumulation operator) and gives
    the same numbers for bf16 inputs, as in training. (A bias would be added inside the compiled matmul
    before the output's rounding: one bf16 ulp, which the e5m2 gradients then magnify.)"""
    lin, _, fusion = _layer(False)
    compiled = torch.compile(lin)
    xs = [torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(3)]
    results = []
    for layer in (lin, compiled):
        lin.weight.grad = None
        ys, gxs = _run(layer, fusion, xs)
        results.append((ys, gxs, lin.weight.grad.clone()))
    (ys_e, gxs_e, gw_e), (ys_c, gxs_c, gw_c) = results
    for a, b in zip(ys_e + gxs_e + [gw_e], ys_c + gxs_c + [gw_c]):
        assert torch.equal(a, b)


def test_parallelize_puts_the_layer_linears_on_the_fusion_in_fp8():
    from megatrain.models.gpt import GPTModel
    from megatrain.models.gpt.config import GPTConfig
    from megatrain.parallel.dims import ParallelDims
    from megatrain.parallel.parallelize import ParallelizeConfig, parallelize_model

    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128,
                    max_position_embeddings=32, position_embedding_type="rope", normalization="RMSNorm",
                    swiglu=True, ffn_hidden_size=96, add_bias_linear=False, untie_embeddings_and_output_weights=True)
    dims = ParallelDims(world_size=1)
    made = {}
    for fused in (False, True):
        with torch.device("meta"):
            model = GPTModel(cfg)
        made[fused] = parallelize_model(model, dims, ParallelizeConfig(
            compute_dtype=torch.bfloat16, fp8_format="hybrid", fp8_fused=fused, cross_entropy_chunk_size=16),
            device=torch.device("cpu"), seed=5)
    fused = made[True]
    layer_linears = [f"layers.{i}.{m}" for i in range(2) for m in
                     ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    assert fused.fp8_report == (layer_linears, []) == made[False].fp8_report
    modules = dict(fused.module.named_modules())
    assert all(type(modules[n]) is Fp8FusedLinear for n in layer_linears)
    assert not any(modules[n].compile_cast for n in layer_linears)  # no --use-torch-compile: no compiled cast
    assert [m for m in fused.grad_fusion.fp8_linears] == [modules[n] for n in layer_linears]
    assert not fused.grad_fusion.linears and len(fused.grad_fusion.slots) == 9  # + the output weight, in bf16
    assert not any(isinstance(m, FusedGradLinear) for m in fused.module.modules())
    assert made[False].grad_fusion is None  # torchao's layers: no fusion
    reference = dict(made[False].module.named_parameters())
    for name, p in fused.module.named_parameters():  # the same names and initial values
        assert torch.equal(p, reference[name]), name


@pytest.mark.parametrize("value, backend", [("", "fused"), ("torchao", "torchao"), ("fused", "fused"),
                                            ("cuda", None)])
def test_the_backend_setting(monkeypatch, value, backend):
    from megatrain.training.run_config import FP8_BACKEND_ENV, fp8_backend_from_env

    monkeypatch.setenv(FP8_BACKEND_ENV, value)
    if backend is None:
        with pytest.raises(ValueError, match="MEGATRAIN_FP8_BACKEND must be torchao or fused"):
            fp8_backend_from_env()
    else:
        assert fp8_backend_from_env() == backend


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with fp8 matmuls (sm89 or later)")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_layer_follows_the_recipe(compiled):
    """On the GPU's fp8 kernels (inner sizes multiples of 16; 200 tokens get padded), eager and compiled
    (the weight casts compiled too), three micro-batches accumulating."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 256, bias=True, device="cuda")
    plain = torch.nn.Linear(512, 256, bias=True, device="cuda")
    plain.load_state_dict(lin.state_dict())
    convert_fp8_linears([lin], "hybrid", torch.bfloat16)
    fusion = GradAccumulationFusion([], torch.bfloat16, fp8_linears=[lin])
    xs = [torch.randn(2, 100, 512, device="cuda", dtype=torch.bfloat16) * s for s in (1.0, 4.0, 0.3)]
    ys, gxs = _run(torch.compile(lin) if compiled else lin, fusion, xs)
    want_y, want_gx, want_gw, want_gb = _expected(plain, xs, E5M2, torch.bfloat16, ys)
    for got, want in zip(ys + gxs, want_y + want_gx):
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=2e-2 * want.abs().max().item())
    # fp8 tensor cores keep fewer bits than float32 while they sum (even without fast accumulation):
    # an entry whose terms cancel can be off by ~1e-3 of the largest entry
    torch.testing.assert_close(lin.weight.grad, want_gw, rtol=1e-2, atol=2e-3 * want_gw.abs().max().item())
    torch.testing.assert_close(lin.bias.grad, want_gb, rtol=2e-2, atol=2e-2 * want_gb.abs().max().item())
