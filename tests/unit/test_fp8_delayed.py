"""Delayed fp8 scaling (``--fp8-recipe delayed``) on megatrain's fp8 layers: the casts against
Transformer Engine's recipe written out in float32 (scales from earlier micro-batches' amaxes, the
history, the margin, both compute algorithms, the start at 1.0), evaluation recording nothing, the
compiled layer equal to eager, the state's round trip through a checkpoint's plain data, and the
flags. (tests/distributed: replicas agree once per step; tests/e2e: a resumed run continues exactly.)"""

from __future__ import annotations

import json
import re

import pytest
import torch

from megatrain.runtime.fp8_fusion import E4M3, E5M2, convert_fp8_linears, quantize
from megatrain.runtime.fp8_scaling import Fp8Recipe, load_state_, state_of
from megatrain.runtime.grad_accumulation_fusion import GradAccumulationFusion
from tests.unit.test_fp8_fusion import _run  # (skips this module too where the CPU has no fp8 matmul)


def _layer(recipe: Fp8Recipe, fmt: str = "hybrid", seed: int = 0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(64, 48, bias=False)
    plain = torch.nn.Linear(64, 48, bias=False)
    plain.load_state_dict(lin.state_dict())
    convert_fp8_linears([lin], fmt, torch.bfloat16, recipe=recipe)
    return lin, plain, GradAccumulationFusion([], torch.bfloat16, fp8_linears=[lin])


class _Reference:
    """Transformer Engine's delayed scaling for one tensor, in plain Python: cast with the scale, then
    record the amax and compute the next scale."""

    def __init__(self, recipe: Fp8Recipe, dtype: torch.dtype):
        self.recipe, self.dtype = recipe, dtype
        self.history = [0.0] * recipe.history_len
        self.scale = 1.0

    def cast(self, t: torch.Tensor) -> tuple[torch.Tensor, float]:
        fmax = torch.finfo(self.dtype).max
        scale = torch.tensor(self.scale, dtype=torch.float32)
        t8 = (t.float() * scale).clamp(-fmax, fmax).to(self.dtype)
        inv = float(scale.reciprocal())
        amax = float(t.abs().amax().float())
        self.history = [amax] + self.history[:-1]
        use = max(self.history) if self.recipe.amax_compute_algo == "max" else amax
        if use > 0 and use != float("inf"):
            self.scale = float(torch.tensor(fmax / 2.0 ** self.recipe.margin / use, dtype=torch.float64).float())
        return t8, inv


@pytest.mark.parametrize("recipe", [Fp8Recipe(True), Fp8Recipe(True, margin=1, history_len=3, amax_compute_algo="max"),
                                    Fp8Recipe(True, history_len=2)], ids=["most_recent", "max_margin", "history_2"])
@pytest.mark.parametrize("fmt, grad_dtype", [("hybrid", E5M2), ("e4m3", E4M3)])
def test_casts_follow_transformer_engines_delayed_recipe(recipe, fmt, grad_dtype):
    lin, plain, fusion = _layer(recipe, fmt)
    # micro-batches whose ranges change: a scale from the last one saturates (x8) or wastes range (x0.1)
    xs = [torch.randn(2, 24, 64) * s for s in (1.0, 8.0, 0.1, 2.0)]
    ys, gxs = _run(lin, fusion, xs)
    w8, w_inv = quantize(plain.weight.detach(), E4M3)
    ref_x, ref_g = _Reference(recipe, E4M3), _Reference(recipe, grad_dtype)
    gw = torch.zeros_like(plain.weight)
    for x, y, gx in zip(xs, ys, gxs):
        x2 = x.reshape(-1, 64).to(torch.bfloat16)
        x8, x_inv = ref_x.cast(x2)
        want_y = ((x8.float() @ w8.float().t()) * x_inv * w_inv).to(torch.bfloat16).float()
        torch.testing.assert_close(y, want_y, rtol=1.6e-2, atol=1e-2 * want_y.abs().max().item())
        g = (2 * y).to(torch.bfloat16)  # d/dy of sum(y^2), from the layer's own output
        g8, g_inv = ref_g.cast(g)
        want_gx = ((g8.float() @ w8.float()) * g_inv * w_inv).to(torch.bfloat16).float()
        torch.testing.assert_close(gx, want_gx, rtol=1.6e-2, atol=1e-2 * want_gx.abs().max().item())
        gw += (g8.float().t() @ x8.float()) * g_inv * x_inv
    torch.testing.assert_close(lin.weight.grad, gw, rtol=1e-5, atol=1e-5 * gw.abs().max().item())
    assert lin.amax_state_in[1:].tolist() == ref_x.history
    assert lin.scale_in.item() == ref_x.scale and lin.scale_grad.item() == ref_g.scale
    assert lin.amax_state_grad[1:].tolist() == pytest.approx(ref_g.history, rel=1e-6)


def test_the_first_cast_uses_scale_one_and_saturates_as_transformer_engine():
    lin, _, fusion = _layer(Fp8Recipe(True))
    fusion.refresh()
    x = torch.full((16, 64), 1000.0)  # beyond e4m3's 448 at scale 1.0: saturated
    with torch.no_grad():
        y = lin(x)
    w8, w_inv = quantize(lin.weight.detach(), E4M3)
    want = (torch.full((16, 64), 448.0) @ w8.float().t() * w_inv).to(torch.bfloat16)
    torch.testing.assert_close(y, want, rtol=1.6e-2, atol=1e-2)


def test_evaluation_casts_with_the_current_scales_and_records_nothing():
    lin, _, fusion = _layer(Fp8Recipe(True, history_len=2))
    _run(lin, fusion, [torch.randn(32, 64)])
    state = [t.clone() for t in (lin.scale_in, lin.amax_state_in, lin.scale_grad, lin.amax_state_grad)]
    with torch.no_grad():
        lin(torch.randn(32, 64) * 100)
    for before, after in zip(state, (lin.scale_in, lin.amax_state_in, lin.scale_grad, lin.amax_state_grad)):
        assert torch.equal(before, after)


def test_an_all_zero_tensor_keeps_the_scale():
    lin, _, fusion = _layer(Fp8Recipe(True))
    _run(lin, fusion, [torch.randn(32, 64)])
    scale = lin.scale_in.item()
    _run(lin, fusion, [torch.zeros(32, 64)])
    assert lin.amax_state_in[1:].tolist() == [0.0] and lin.scale_in.item() == scale


def test_compiled_layer_equals_eager():
    """Inductor traces the casts, the amax recording and its opaque store (forward and backward)."""
    recipe = Fp8Recipe(True, history_len=2, amax_compute_algo="max")
    xs = [torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(i)).bfloat16() * (i + 1) for i in range(3)]
    results = []
    for compiled in (False, True):
        lin, _, fusion = _layer(recipe)
        layer = torch.compile(lin) if compiled else lin
        ys, gxs = _run(layer, fusion, xs)
        results.append(ys + gxs + [lin.weight.grad.clone(), lin.scale_in.clone(), lin.amax_state_in.clone(),
                                   lin.scale_grad.clone(), lin.amax_state_grad.clone()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_state_round_trips_through_plain_data_and_adapts_to_another_history_length():
    recipe = Fp8Recipe(True, history_len=3, amax_compute_algo="max")
    lin, _, fusion = _layer(recipe)
    _run(lin, fusion, [torch.randn(32, 64) * s for s in (1, 2)])
    saved = json.loads(json.dumps(state_of([lin], ["layer"], recipe)))  # as meta.json holds it
    other, _, _ = _layer(recipe, seed=1)
    assert load_state_([other], ["layer"], recipe, saved) == []
    for name in ("scale_in", "amax_state_in", "scale_grad", "amax_state_grad"):
        assert torch.equal(getattr(lin, name), getattr(other, name)), name
    shorter = Fp8Recipe(True, history_len=1)
    small, _, _ = _layer(shorter)
    notes = load_state_([small], ["layer"], shorter, saved)
    assert "hold 3 entries" in notes[0]
    assert small.amax_state_in.tolist() == lin.amax_state_in[:2].tolist()
    missing = load_state_([small], ["other"], shorter, saved)
    assert any("no fp8 scales for 1" in n for n in missing)
    saved["layers"]["layer"]["grad"] = [2.0, float("inf")]  # an overflow the run recorded: kept
    load_state_([small], ["layer"], shorter, saved)
    assert small.amax_state_grad.tolist() == [2.0, float("inf")] and small.scale_grad.item() == 2.0
    for bad in ("oops", [float("nan"), 1.0], [0.0, 1.0], [float("inf"), 1.0], [1.0, -2.0], [True, 1.0], [1.0]):
        saved["layers"]["layer"]["grad"] = bad
        with pytest.raises(ValueError, match="layer layer: malformed 'grad'"):
            load_state_([small], ["layer"], shorter, saved)


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128"]


@pytest.mark.parametrize("extra, recipe", [
    ([], Fp8Recipe()),
    (["--fp8-recipe", "delayed"], Fp8Recipe(True)),
    (["--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"],  # Megatron's examples: delayed implied
     Fp8Recipe(True, history_len=1024, amax_compute_algo="max")),
    (["--fp8-recipe", "delayed", "--fp8-margin", "2"], Fp8Recipe(True, margin=2)),
])
def test_flags_settle_the_recipe(extra, recipe):
    from megatrain.training.arguments import parse_args
    from megatrain.training.run_config import RunConfig

    args = parse_args([*BASE, "--bf16", "--fp8-format", "hybrid", *extra], validate=True)
    assert RunConfig.from_args(args).parallelize.fp8_recipe == recipe


@pytest.mark.parametrize("extra, message", [
    (["--fp8-amax-history-len", "0"], "--fp8-amax-history-len must be >= 1, got 0"),
    (["--fp8-margin", "-1"], "--fp8-margin must be >= 0, got -1"),
    (["--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8 is not supported"),
])
def test_bad_fp8_settings_get_one_line(extra, message):
    from megatrain.training.arguments import parse_args

    with pytest.raises(SystemExit, match=re.escape(message)):
        parse_args([*BASE, "--bf16", "--fp8-format", "hybrid", *extra], validate=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with fp8 matmuls (sm89 or later)")
def test_cuda_compiled_layer_follows_the_delayed_recipe():
    """On the GPU's fp8 kernels, compiled (the casts, the amax recording and its opaque store in
    Triton kernels): the histories and scales are Transformer Engine's, and the outputs follow
    eager's within the kernels' rounding."""
    recipe = Fp8Recipe(True, history_len=2, amax_compute_algo="max")
    gen = torch.Generator("cuda").manual_seed(0)
    xs = [torch.randn(2, 100, 512, device="cuda", dtype=torch.bfloat16, generator=gen) * (i + 1) for i in range(3)]
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        lin = torch.nn.Linear(512, 256, bias=False, device="cuda")
        convert_fp8_linears([lin], "hybrid", torch.bfloat16, recipe=recipe)
        fusion = GradAccumulationFusion([], torch.bfloat16, fp8_linears=[lin])
        ys, gxs = _run(torch.compile(lin) if compiled else lin, fusion, xs)
        results.append((ys, gxs, lin))
    (ys_e, gxs_e, eager), (ys_c, gxs_c, comp) = results
    ref = _Reference(recipe, E4M3)
    for x in xs:
        ref.cast(x.reshape(-1, 512))
    assert comp.amax_state_in[1:].tolist() == ref.history and comp.scale_in.item() == ref.scale
    assert torch.equal(comp.amax_state_in, eager.amax_state_in)
    for a, b in zip(ys_e + gxs_e, ys_c + gxs_c):
        torch.testing.assert_close(b, a, rtol=1.6e-2, atol=2e-2 * a.abs().max().item())
    torch.testing.assert_close(comp.amax_state_grad, eager.amax_state_grad, rtol=2e-2, atol=0)


def test_a_subnormal_amax_gives_float32s_largest_scale():
    lin, _, fusion = _layer(Fp8Recipe(True))
    _run(lin, fusion, [torch.full((32, 64), 1e-40)])
    assert lin.scale_in.item() == torch.finfo(torch.float32).max
