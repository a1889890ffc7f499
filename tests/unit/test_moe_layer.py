"""The mixture-of-experts layer's token movement, experts and assembly, and its place in the GPT family.

Token functions on crafted routings (which tokens each drop policy keeps, padding to capacity, the
expert-major order, the weighted inverse and its dtype); the experts' per-expert loop against an
explicit per-token computation and the grouped matmul against the loop; ``MoELayer`` forward and
backward against a dense reference written here (every expert on every token, weighted by the routing
probabilities, dropped tokens removed by a plain-Python reading of the policies); shared experts and
their gate; MoE layer placement, initial values, the tensor-parallel plan, FLOPs and parameter counts.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from megatrain.models.common.moe import token_ops
from megatrain.models.common.moe.dispatcher import LocalDispatcher
from megatrain.models.common.moe.experts import GroupedExperts, grouped_linear
from megatrain.models.common.moe.layer import MoELayer, SharedExpertMLP
from megatrain.models.common.mlp import MLP
from megatrain.models.common.tp_plan import SharedExpertGateParallel, layers_plan
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt.flops import num_floating_point_operations
from megatrain.models.gpt.memory import active_parameter_count, estimate_memory, parameter_counts
from megatrain.models.gpt.model import GPTModel, initial_value
from megatrain.parallel.parallelize import init_parameters

BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=64, max_position_embeddings=32,
            hidden_dropout=0.0, attention_dropout=0.0, ffn_hidden_size=24, num_moe_experts=4, moe_router_topk=2,
            moe_ffn_hidden_size=8)
LLAMA = dict(BASE, swiglu=True, add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope")
GPT2 = dict(BASE, swiglu=False, add_bias_linear=True, gelu_approximation="tanh")


def config(**kw) -> GPTConfig:
    return GPTConfig(**{**LLAMA, **kw})


def init_layer(layer: torch.nn.Module, cfg: GPTConfig, seed: int = 0, prefix: str = "layers.0.mlp.") -> None:
    """The GPT family's initial values (biases made non-zero so that they are tested too)."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(initial_value(prefix + name, p.shape, cfg, seed))
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)


# ---- token functions -----------------------------------------------------------------------------

def test_expert_capacity_is_megatrons_get_capacity():
    assert token_ops.expert_capacity(10, 4, 2, 1.0) == 5  # ceil(10 * 2 / 4 * 1.0)
    assert token_ops.expert_capacity(10, 4, 2, 1.5) == 8  # ceil(7.5)
    assert token_ops.expert_capacity(7, 8, 1, 1.0) == 1  # ceil(0.875)
    assert token_ops.expert_capacity(7, 8, 1, 1.0, min_capacity=4) == 4
    assert token_ops.expert_capacity(16, 4, 2, 0.5) == 4


def _crafted():
    # 6 tokens, 2 experts, top-1: expert 0 gets tokens 0 1 2 3 4, expert 1 token 5
    weights = torch.tensor([0.5, 0.9, 0.7, 0.9, 0.9, 0.6])
    routing_map = torch.zeros(6, 2, dtype=torch.bool)
    routing_map[:5, 0] = True
    routing_map[5, 1] = True
    probs = torch.zeros(6, 2)
    probs[routing_map] = weights
    return probs, routing_map


def test_drop_by_probs_keeps_the_highest_weights_earliest_first_on_ties():
    probs, routing_map = _crafted()
    new_probs, new_map = token_ops.drop_tokens(probs, routing_map, capacity=2, policy="probs")
    assert new_map[:, 0].nonzero().flatten().tolist() == [1, 3]  # 0.9, 0.9 (token 4's 0.9 is later)
    assert new_map[:, 1].nonzero().flatten().tolist() == [5]
    assert torch.equal(new_probs, probs * new_map) and new_probs[4, 0] == 0 and new_probs[0, 0] == 0


def test_drop_by_position_keeps_the_first_tokens():
    probs, routing_map = _crafted()
    _, new_map = token_ops.drop_tokens(probs, routing_map, capacity=3, policy="position")
    assert new_map[:, 0].nonzero().flatten().tolist() == [0, 1, 2]
    assert new_map[:, 1].nonzero().flatten().tolist() == [5]


def test_no_drop_when_capacity_covers_all_tokens():
    probs, routing_map = _crafted()
    for policy in token_ops.DROP_POLICIES:
        new_probs, new_map = token_ops.drop_tokens(probs, routing_map, capacity=6, policy=policy)
        assert torch.equal(new_map, routing_map) and torch.equal(new_probs, probs)


def test_bad_policy_names_the_flag():
    probs, routing_map = _crafted()
    with pytest.raises(ValueError, match="--moe-token-drop-policy"):
        token_ops.drop_tokens(probs, routing_map, capacity=2, policy="random")


@pytest.mark.parametrize("policy", token_ops.DROP_POLICIES)
def test_padding_fills_free_slots_with_weightless_tokens(policy):
    probs, routing_map = _crafted()
    new_probs, new_map = token_ops.drop_tokens(probs, routing_map, capacity=3, policy=policy, pad_to_capacity=True)
    assert new_map.sum(0).tolist() == [3, 3]
    kept = {"probs": [1, 3, 4], "position": [0, 1, 2]}[policy]
    assert new_map[:, 0].nonzero().flatten().tolist() == kept
    assert new_map[:, 1].nonzero().flatten().tolist() == [0, 1, 5]  # token 5 and the first free tokens
    assert new_probs[0, 1] == 0 and new_probs[1, 1] == 0 and new_probs[5, 1] == probs[5, 1]
    x = torch.arange(12.0).reshape(6, 2)
    rows, row_probs, index = token_ops.permute_to_capacity(x, new_map, new_probs, 3)
    assert index.tolist() == [*kept, 0, 1, 5] and torch.equal(rows, x[index])
    assert torch.equal(row_probs, new_probs.t()[new_map.t()])


def test_padding_beyond_the_tokens_adds_zero_rows():
    probs, routing_map = _crafted()
    new_probs, new_map = token_ops.drop_tokens(probs, routing_map, capacity=8, policy="probs", pad_to_capacity=True)
    assert new_map.all()
    x = torch.randn(6, 3)
    rows, row_probs, index = token_ops.permute_to_capacity(x, new_map, new_probs, 8)
    assert rows.shape == (16, 3) and index.tolist() == [0, 1, 2, 3, 4, 5, 6, 6] * 2
    assert rows[6:8].abs().sum() == 0 and row_probs[6:8].abs().sum() == 0
    out = token_ops.unpermute(rows * 2.0, index, 6, row_probs, pad_row=True)
    assert torch.allclose(out, 2.0 * x * probs.sum(1, keepdim=True))


def test_permute_is_expert_major_in_token_order_and_unpermute_weights_and_sums():
    routing_map = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # 4 tokens, top-2
    probs = torch.rand(4, 3) * routing_map
    x = torch.randn(4, 5)
    rows, row_probs, index = token_ops.permute(x, routing_map, probs, num_out=8)
    assert index.tolist() == [0, 2, 3, 1, 2, 0, 1, 3]
    assert torch.equal(rows, x[index]) and torch.equal(row_probs, probs.t()[routing_map.t()])
    assert token_ops.permute(x, routing_map, probs)[2].tolist() == index.tolist()  # counted on the host
    # identity experts: each token's weights summed
    assert torch.allclose(token_ops.unpermute(rows, index, 4, row_probs), x * probs.sum(1, keepdim=True))
    assert torch.allclose(token_ops.unpermute(rows, index, 4), 2 * x)  # unweighted: the top-k copies


def test_unpermute_accumulates_in_the_weights_dtype_and_returns_the_rows_dtype():
    torch.manual_seed(0)
    routing_map = torch.zeros(64, 4, dtype=torch.bool)
    routing_map[:, :2] = True
    probs = torch.rand(64, 4) * routing_map
    rows, row_probs, index = token_ops.permute(torch.randn(64, 32).bfloat16(), routing_map, probs, num_out=128)
    out = token_ops.unpermute(rows, index, 64, row_probs)
    expected = token_ops.unpermute(rows.float(), index, 64, row_probs).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


# ---- experts ---------------------------------------------------------------------------------------

def _expert_reference(experts: GroupedExperts, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
    """Token by token: fc1 row by row, the interleaved SwiGLU pairs (or GELU), fc2."""
    w1, w2 = experts.linear_fc1.weight, experts.linear_fc2.weight
    b1, b2 = experts.linear_fc1.bias, experts.linear_fc2.bias
    owners = [e for e, n in enumerate(tokens_per_expert) for _ in range(n)]
    out = []
    for t, e in enumerate(owners):
        h = w1[e] @ x[t] + (b1[e] if b1 is not None else 0)
        if experts.swiglu:
            h = torch.stack([F.silu(h[2 * i]) * h[2 * i + 1] for i in range(h.shape[0] // 2)])
        else:
            h = F.gelu(h, approximate=experts.gelu_approximation)
        out.append(w2[e] @ h + (b2[e] if b2 is not None else 0))
    return torch.stack(out)


@pytest.mark.parametrize("style", [LLAMA, GPT2], ids=["swiglu", "gelu_bias"])
def test_expert_loop_matches_a_per_token_reference(style):
    cfg = GPTConfig(**style)
    experts = GroupedExperts(cfg)
    init_layer(experts, cfg, prefix="layers.0.mlp.experts.")
    counts = [3, 0, 5, 2]  # an expert without tokens too
    x = torch.randn(10, cfg.hidden_size)
    out = experts(x, torch.tensor(counts))
    assert torch.allclose(out, _expert_reference(experts, x, counts), atol=1e-6)
    assert experts.linear_fc1.weight.shape == (4, 16 if cfg.swiglu else 8, 16)
    assert experts.linear_fc2.weight.shape == (4, 16, 8)


def _grouped_mm_on_cpu() -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        torch._grouped_mm(torch.randn(8, 16), torch.randn(2, 16, 8), offs=torch.tensor([4, 8], dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _compare_paths(cfg: GPTConfig, device: str, dtype: torch.dtype | None) -> tuple[float, float]:
    """(output error, worst gradient error) of the grouped matmul against the loop."""
    torch.manual_seed(0)
    experts = GroupedExperts(cfg).to(device)
    init_layer(experts, cfg, prefix="layers.0.mlp.experts.")
    counts = torch.tensor([5, 0, 7, 4], device=device)
    x = torch.randn(16, cfg.hidden_size, device=device)
    results = []
    for grouped in (True, False):
        experts.use_grouped_mm = grouped
        experts.zero_grad()
        xi = x.clone().requires_grad_(True)
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            out = experts(xi, counts)
        (out.float() * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
        results.append((out.float(), [xi.grad] + [p.grad.clone() for p in experts.parameters()]))
    (out_g, grads_g), (out_l, grads_l) = results
    scale = out_l.abs().max()
    return ((out_g - out_l).abs().max() / scale).item(), max(((a - b).abs().max() / b.abs().max()).item()
                                                            for a, b in zip(grads_g, grads_l))


@pytest.mark.skipif(not _grouped_mm_on_cpu(), reason="this torch has no CPU torch._grouped_mm")
@pytest.mark.parametrize("style", [LLAMA, GPT2], ids=["swiglu", "gelu_bias"])
def test_grouped_matmul_matches_the_loop_on_cpu(style):
    out_err, grad_err = _compare_paths(GPTConfig(**style, moe_grouped_gemm=True), "cpu", None)
    assert out_err < 1e-6 and grad_err < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("style", [LLAMA, GPT2], ids=["swiglu", "gelu_bias"])
def test_grouped_matmul_matches_the_loop_on_cuda_bf16(style):
    cfg = GPTConfig(**style, moe_grouped_gemm=True)
    experts = GroupedExperts(cfg).cuda()
    experts.use_grouped_mm = None
    assert experts._grouped_applies(torch.empty(1, device="cuda"), torch.bfloat16)  # the automatic choice
    out_err, grad_err = _compare_paths(cfg, "cuda", torch.bfloat16)
    assert out_err < 2e-2 and grad_err < 3e-2


def test_grouped_path_is_not_chosen_where_it_does_not_apply():
    experts = GroupedExperts(config(moe_grouped_gemm=True))
    assert not experts._grouped_applies(torch.empty(1), torch.bfloat16)  # CPU: the loop
    assert not GroupedExperts(config())._grouped_applies(torch.empty(1), torch.bfloat16)  # flag off
    if hasattr(torch, "_grouped_mm"):
        x = torch.randn(6, 16)
        w = torch.randn(2, 8, 16)
        counts = torch.tensor([2, 4])
        if _grouped_mm_on_cpu():
            assert torch.allclose(grouped_linear(x, w, None, counts), torch.cat([x[:2] @ w[0].T, x[2:] @ w[1].T]),
                                  atol=1e-5)


# ---- the layer against a dense reference ------------------------------------------------------------

def _reference_drop(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, policy: str) -> torch.Tensor:
    """Plain Python: each expert's routed tokens in its keeping order, the first ``capacity`` kept."""
    keep = torch.zeros_like(routing_map)
    for e in range(routing_map.shape[1]):
        routed = [t for t in range(routing_map.shape[0]) if routing_map[t, e]]
        if policy == "probs":
            routed.sort(key=lambda t: (-float(probs[t, e]), t))
        for t in routed[:capacity]:
            keep[t, e] = True
    return keep


def _dense_reference(layer: MoELayer, x: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """Every expert on every token, weighted by the router's probabilities (dropped ones zeroed)."""
    tokens = x.reshape(-1, x.shape[-1])
    probs, routing_map = layer.router(x)
    if cfg.moe_expert_capacity_factor is not None:
        capacity = token_ops.expert_capacity(tokens.shape[0], cfg.num_moe_experts, cfg.moe_router_topk,
                                             cfg.moe_expert_capacity_factor)
        probs = probs * _reference_drop(probs.detach(), routing_map, capacity, cfg.moe_token_drop_policy)
    out = torch.zeros_like(tokens)
    fc1, fc2 = layer.experts.linear_fc1, layer.experts.linear_fc2
    for e in range(cfg.num_moe_experts):
        one = [t[e:e + 1] if t is not None else None for t in (fc1.weight, fc1.bias, fc2.weight, fc2.bias)]
        every = layer.experts._loop(tokens, torch.tensor([tokens.shape[0]]), *one)
        out = out + probs[:, e:e + 1].to(every.dtype) * every
    out = out.reshape(x.shape)
    if layer.shared_experts is not None:
        shared = layer.shared_experts
        h = F.linear(x, shared.linear_fc1.weight)
        gate_up = h.unflatten(-1, (-1, 2)) if cfg.swiglu else None
        h = F.silu(gate_up[..., 0]) * gate_up[..., 1] if cfg.swiglu else F.gelu(h, approximate=cfg.gelu_approximation)
        s = F.linear(h, shared.linear_fc2.weight)
        if shared.gate_weight is not None:
            s = s * torch.sigmoid(x @ shared.gate_weight.t())
        out = out + s
    return out


CASES = {
    "dropless_swiglu": {},
    "dropless_gelu_bias": dict(GPT2),
    "shared_experts": dict(moe_shared_expert_intermediate_size=12),
    "shared_experts_gate": dict(moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True),
    "drop_probs": dict(moe_expert_capacity_factor=0.5),
    "drop_position": dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position"),
    "drop_probs_padded": dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True),
    "pad_beyond_tokens": dict(moe_expert_capacity_factor=8.0, moe_pad_expert_input_to_capacity=True,
                              moe_token_drop_policy="position"),
    "sigmoid_fp32_router": dict(moe_router_score_function="sigmoid", moe_router_dtype="fp32", moe_router_topk=1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_layer_matches_the_dense_reference(name):
    kw = CASES[name]
    cfg = GPTConfig(**{**LLAMA, **kw})
    torch.manual_seed(1)
    layer = MoELayer(cfg, layer_number=0)
    init_layer(layer, cfg)
    x = torch.randn(2, 8, cfg.hidden_size)
    weight = torch.randn(2, 8, cfg.hidden_size)
    runs = []
    for fn in (layer, lambda v: _dense_reference(layer, v, cfg)):
        layer.zero_grad()
        xi = x.clone().requires_grad_(True)
        out = fn(xi)
        (out * weight).sum().backward()
        runs.append((out.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (out, gx, grads), (ref, rgx, rgrads) = runs
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    assert torch.allclose(gx, rgx, atol=1e-5)
    for n in grads:
        assert torch.allclose(grads[n], rgrads[n], atol=1e-5), n
    if cfg.moe_expert_capacity_factor is not None and cfg.moe_expert_capacity_factor < 1:
        assert not torch.allclose(out, _no_drop(layer, cfg, x)), "nothing was dropped: a weak check"


def _no_drop(layer: MoELayer, cfg: GPTConfig, x: torch.Tensor) -> torch.Tensor:
    dropless = LocalDispatcher(dataclasses.replace(cfg, moe_expert_capacity_factor=None,
                                                   moe_pad_expert_input_to_capacity=False))
    saved, layer.dispatcher = layer.dispatcher, dropless
    try:
        with torch.no_grad():
            return layer(x)
    finally:
        layer.dispatcher = saved


def test_padded_dispatch_gives_every_expert_its_capacity():
    cfg = config(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True)
    dispatcher = LocalDispatcher(cfg)
    probs = torch.softmax(torch.randn(16, 4), -1)
    top = probs.topk(2, dim=1).indices
    routing_map = torch.zeros(16, 4, dtype=torch.bool).scatter(1, top, True)
    rows, tokens_per_expert = dispatcher.dispatch(torch.randn(16, 16), probs * routing_map, routing_map)
    assert tokens_per_expert.tolist() == [4, 4, 4, 4] and rows.shape == (16, 16)
    assert dispatcher.combine(rows).shape == (16, 16)
    with pytest.raises(AssertionError, match="without dispatch"):
        dispatcher.combine(rows)


def test_dispatcher_expert_range_permutes_only_those_experts():
    cfg = config()
    dispatcher = LocalDispatcher(cfg, expert_range=(2, 4))
    assert (dispatcher.local_expert_start, dispatcher.num_local_experts) == (2, 2)
    routing_map = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1], [0, 0, 1, 1]], dtype=torch.bool)
    probs = routing_map.float() * 0.5
    x = torch.randn(3, 16)
    rows, counts = dispatcher.dispatch(x, probs, routing_map)
    assert counts.tolist() == [2, 2] and torch.equal(rows, x[[0, 2, 1, 2]])
    assert torch.allclose(dispatcher.combine(rows), x * torch.tensor([[0.5], [0.5], [1.0]]))


def test_shared_experts_need_no_biases_and_gate_is_a_sigmoid():
    with pytest.raises(ValueError, match="--disable-bias-linear"):
        SharedExpertMLP(GPTConfig(**GPT2, moe_shared_expert_intermediate_size=8))
    cfg = config(moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True)
    shared = SharedExpertMLP(cfg)
    assert isinstance(shared, MLP) and shared.linear_fc1.weight.shape == (24, 16)
    assert shared.gate_weight.shape == (1, 16)
    x = torch.randn(3, 16)
    dense = MLP(dataclasses.replace(cfg, ffn_hidden_size=12))
    dense.load_state_dict({k: v for k, v in shared.state_dict().items() if k != "gate_weight"})
    assert torch.allclose(shared(x), dense(x) * torch.sigmoid(x @ shared.gate_weight.t()))


def test_bf16_autocast_output_dtype_and_fp32_router_probs():
    cfg = config(moe_router_dtype="fp32", moe_shared_expert_intermediate_size=8)
    layer = MoELayer(cfg)
    x = torch.randn(2, 4, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probs, _ = layer.router(x)
        out = layer(x)
    assert probs.dtype == torch.float32 and out.dtype == torch.bfloat16 and out.shape == x.shape


# ---- the GPT family ----------------------------------------------------------------------------------

def test_moe_layer_freq_places_the_moe_layers():
    for freq, expected in [(1, [1, 1, 1, 1]), (2, [1, 0, 1, 0]), ([0, 1, 1, 0], [0, 1, 1, 0])]:
        model = GPTModel(config(num_layers=4, moe_layer_freq=freq))
        kinds = [int(isinstance(layer.mlp, MoELayer)) for layer in model.layers.values()]
        assert kinds == expected, freq
        for i, layer in model.layers.items():
            assert not isinstance(layer.mlp, MoELayer) or layer.mlp.router.layer_number == int(i)
    dense = GPTModel(config(num_moe_experts=None, moe_ffn_hidden_size=None))
    assert not any(isinstance(layer.mlp, MoELayer) for layer in dense.layers.values())


def test_initial_values_follow_megatron_and_do_not_depend_on_the_layout():
    cfg = config(num_layers=4, moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True,
                 moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, init_method_std=0.05)
    with torch.device("meta"):
        meta = GPTModel(cfg)
    meta.to_empty(device="cpu")
    init_parameters(meta, cfg, seed=7)
    whole = GPTModel(cfg)
    whole.init_weights(7)
    for (name, a), (_, b) in zip(meta.state_dict().items(), whole.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(meta.layers["0"].mlp.router.expert_bias, torch.zeros(4))  # a buffer, zero
    p = dict(whole.named_parameters())
    std = {"layers.0.mlp.router.weight": 0.05, "layers.0.mlp.experts.linear_fc1.weight": 0.05,
           "layers.0.mlp.shared_experts.gate_weight": 0.05, "layers.0.mlp.shared_experts.linear_fc1.weight": 0.05,
           "layers.0.mlp.experts.linear_fc2.weight": 0.05 / math.sqrt(8)}
    for name, s in std.items():
        assert abs(p[name].std().item() / s - 1) < 0.35, name
    # seeded by the full name and shape: one expert's slice is the same whatever holds the rest
    name = "layers.1.mlp.experts.linear_fc1.weight"
    assert torch.equal(initial_value(name, p[name].shape, cfg, 7)[2:], p[name][2:])
    assert not torch.equal(p[name], p["layers.0.mlp.experts.linear_fc1.weight"])


def test_tensor_parallel_plan_skips_moe_mlps_and_splits_shared_experts():
    model = GPTModel(config(num_layers=2, moe_layer_freq=[1, 0], moe_shared_expert_intermediate_size=8,
                            moe_shared_expert_gate=True))
    for sp in (False, True):
        styles = dict(layers_plan(model.layers, model.config, sp).styles)
        assert "layers.0.mlp.linear_fc1" not in styles and "layers.1.mlp.linear_fc1" in styles
        assert {"layers.0.mlp.shared_experts.linear_fc1", "layers.0.mlp.shared_experts.linear_fc2"} <= styles.keys()
        assert not any(k.startswith(("layers.0.mlp.router", "layers.0.mlp.experts")) for k in styles)
        assert isinstance(styles.get("layers.0.mlp.shared_experts"), SharedExpertGateParallel) == sp
        if sp:  # the MoE layer's input stays this rank's sequence part, the dense MLP's is gathered
            assert "Shard(dim=1)" in repr(styles["layers.0.mlp"].desired_input_layouts)
            assert "Replicate" in repr(styles["layers.1.mlp"].desired_input_layouts)


MOE_SHAPES = {
    "llama_all_moe": dict(LLAMA),
    "gelu_bias_every_other": dict(GPT2, num_layers=4, moe_layer_freq=2),
    "shared_gate_pattern": dict(LLAMA, num_layers=3, moe_layer_freq=[0, 1, 1], moe_shared_expert_intermediate_size=12,
                                moe_shared_expert_gate=True),
}


@pytest.mark.parametrize("name", list(MOE_SHAPES))
def test_parameter_counts_total_and_active(name):
    cfg = GPTConfig(**MOE_SHAPES[name])
    with torch.device("meta"):
        model = GPTModel(cfg)
    total = model.num_parameters()
    assert parameter_counts(cfg)[2] == total
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    k, e = cfg.moe_router_topk, cfg.num_moe_experts
    assert active_parameter_count(cfg) == total - experts + experts * k // e
    one = estimate_memory(cfg, seq_length=16, micro_batch_size=1)
    assert one.parameters_rank == total and one.parameters_active == active_parameter_count(cfg)
    assert f"active {one.parameters_active:,}" in one.line()
    ep2 = estimate_memory(cfg, seq_length=16, micro_batch_size=1, expert_parallel_size=2)
    assert ep2.parameters_rank == total - experts // 2
    dense = estimate_memory(GPTConfig(**{**MOE_SHAPES[name], "num_moe_experts": None, "moe_ffn_hidden_size": None,
                                         "moe_layer_freq": 1, "moe_shared_expert_intermediate_size": None,
                                         "moe_shared_expert_gate": False}), seq_length=16, micro_batch_size=1)
    assert dense.parameters_active is None and "active" not in dense.line()


@pytest.mark.parametrize("name", list(MOE_SHAPES))
def test_flops_are_megatrons_moe_formula(name):
    cfg = GPTConfig(**MOE_SHAPES[name])
    B, s = 4, 16
    h, L, V = cfg.hidden_size, cfg.num_layers, cfg.vocab_size
    n, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    moe = sum(cfg.is_moe_layer(i) for i in range(L))
    glu = 3 if cfg.swiglu else 2
    shared = cfg.moe_shared_expert_intermediate_size or 0
    # Megatron's transformer_flops: 3 (fwd + 2 bwd) x 2 (FMA) per GEMM
    mlp = 3 * 2 * h * (cfg.ffn_hidden_size * glu * (L - moe) + cfg.moe_ffn * cfg.moe_router_topk * glu * moe
                       + shared * glu * moe)
    attn = 3 * 2 * (h * (n * d + 2 * g * d) + n * d * h) * L
    logit = 3 * 2 * h * V
    core = 3 * 2 * n * d / 2 * 2 * L
    expected = B * s * (mlp + attn + logit) + B * s * s * core
    assert num_floating_point_operations(cfg, B, s) == pytest.approx(expected, rel=1e-12)


def test_config_round_trips_through_meta_json():
    cfg = config(num_layers=3, moe_layer_freq=[1, 0, 1], moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                 moe_aux_loss_coeff=[1e-2, 1e-3], moe_shared_expert_intermediate_size=8, moe_expert_capacity_factor=1.5)
    back = GPTConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert back == cfg and back.moe_layer_freq == [1, 0, 1]
    assert [back.is_moe_layer(i) for i in range(3)] == [True, False, True]
