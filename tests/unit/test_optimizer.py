"""Megatron parameter groups, AdamW semantics and gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megatrain.training.lr_schedule import LRScheduleConfig, LRScheduler
from megatrain.optimizer import (
    OptimizerConfig,
    build_optimizer,
    build_param_groups,
    clip_grad_norm_,
    get_grad_norm,
)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 4)
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2, bias=False)
        self.gate = nn.Parameter(torch.tensor(0.5))      # 0-dim: decayed, as Megatron does
        self.frozen = nn.Parameter(torch.ones(2, 2), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.norm(self.embedding(x))))) * self.gate


def _names(model: nn.Module, group: dict) -> set[str]:
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_param_groups_follow_megatron():
    torch.manual_seed(0)
    m = Tiny()
    decay, no_decay = build_param_groups(m, OptimizerConfig(lr=1e-3, min_lr=1e-5, weight_decay=0.1))
    assert _names(m, decay) == {"embedding.weight", "fc.weight", "head.weight", "gate"}
    assert _names(m, no_decay) == {"norm.weight", "norm.bias", "fc.bias"}
    assert (decay["wd_mult"], no_decay["wd_mult"]) == (1.0, 0.0)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    for g in (decay, no_decay):
        assert g["lr_mult"] == 1.0 and g["max_lr"] == 1e-3 and g["min_lr"] == 1e-5 and g["default_config"]


def test_groups_exist_even_when_empty_and_chunks_share_params():
    a = nn.Linear(3, 3, bias=False)
    groups = build_param_groups([a, a], OptimizerConfig())
    assert [len(g["params"]) for g in groups] == [1, 0]
    opt = build_optimizer(a, OptimizerConfig())
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_a_model_with_nothing_to_train_is_refused_unless_allowed(kind):
    """A pipeline rank whose stages are frozen (LLaVA's --freeze-LM) gets an optimizer over the empty
    groups: it steps (also with found_inf, as the trainer queues fused steps) and changes nothing."""
    m = Tiny().requires_grad_(False)
    cfg = OptimizerConfig(optimizer=kind)
    with pytest.raises(ValueError, match="the model has no trainable parameters"):
        build_optimizer(m, cfg)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = build_optimizer(m, cfg, allow_empty=True)
    assert [len(g["params"]) for g in opt.param_groups] == [0, 0] and opt.defaults["foreach"] is True
    LRScheduler(opt, LRScheduleConfig(lr=1e-3, lr_decay_steps=16)).step(8)
    opt.zero_grad(set_to_none=True)
    opt.step()
    # the kernels the run's device would give (so the trainer's step takes the other ranks' path:
    # fused, queued with found_inf)
    fused = build_optimizer(m, cfg, allow_empty=True, device=torch.device("cuda", 0))
    assert fused.defaults["fused"] is True
    fused.found_inf = torch.zeros(())
    fused.step()
    assert opt.state_dict()["state"] == {} and fused.state_dict()["state"] == {}
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in m.named_parameters())


def test_kernel_choice_on_cpu_is_foreach():
    opt = build_optimizer(Tiny(), OptimizerConfig())
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["foreach"] is True and not opt.defaults.get("fused")
    sgd = build_optimizer(Tiny(), OptimizerConfig(optimizer="sgd", sgd_momentum=0.8))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.8
    assert isinstance(build_optimizer(Tiny(), OptimizerConfig(decoupled_weight_decay=False)), torch.optim.Adam)
    with pytest.raises(ValueError, match="--optimizer"):
        OptimizerConfig(optimizer="lamb")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_choice_on_cuda_is_fused():
    opt = build_optimizer(Tiny().cuda(), OptimizerConfig())
    assert opt.defaults["fused"] is True


def _reference_adamw(params, grads_per_step, lr, wd_per_param, b1, b2, eps):
    """Megatron's Adam in AdamW mode, written out step by step."""
    p = [x.detach().clone().double() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            p[i] = p[i] * (1 - lr * wd_per_param[i])
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat = m[i] / (1 - b1**t)
            v_hat = v[i] / (1 - b2**t)
            p[i] = p[i] - lr * m_hat / (v_hat.sqrt() + eps)
    return p


def test_adamw_matches_hand_written_update():
    torch.manual_seed(0)
    m = Tiny()
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
    opt = build_optimizer(m, cfg)
    trainable = [p for p in m.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in trainable]
    no_decay_ids = {id(p) for p in opt.param_groups[1]["params"]}
    wd = [0.0 if id(p) in no_decay_ids else 0.1 for p in trainable]
    grads_per_step = []
    x = torch.randint(0, 11, (5, 7))
    for _ in range(4):
        opt.zero_grad()
        m(x).square().mean().backward()
        grads_per_step.append([p.grad.detach().clone() for p in trainable])
        opt.step()
    expected = _reference_adamw(start, grads_per_step, 1e-2, wd, 0.9, 0.95, 1e-8)
    for p, e in zip(trainable, expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-6)
    assert torch.equal(m.frozen, torch.ones(2, 2))   # frozen parameters are left alone


def test_scheduler_drives_groups():
    m = Tiny()
    opt = build_optimizer(m, OptimizerConfig(lr=1e-3, weight_decay=0.1))
    sched = LRScheduler(opt, LRScheduleConfig(lr=1e-3, lr_decay_steps=100, lr_warmup_steps=10, weight_decay=0.1))
    sched.step(5)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(5e-4)] * 2
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def _with_grads(*grads):
    ps = []
    for g in grads:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        ps.append(p)
    return ps


def test_clip_grad_norm_clips_and_returns_norm_before_clipping():
    ps = _with_grads(torch.tensor([3.0, 0.0]), torch.tensor([[4.0]]), torch.tensor([0.0], dtype=torch.bfloat16))
    ps.append(nn.Parameter(torch.zeros(3)))  # no grad
    norm = clip_grad_norm_(ps, max_norm=1.0)
    assert norm.dim() == 0 and norm.dtype == torch.float32
    assert norm.item() == pytest.approx(5.0)
    coef = 1.0 / (5.0 + 1e-6)
    torch.testing.assert_close(ps[0].grad, torch.tensor([3.0 * coef, 0.0]))
    torch.testing.assert_close(ps[1].grad, torch.tensor([[4.0 * coef]]))
    # Compare with torch's own implementation on the same input.
    a = _with_grads(torch.randn(7, 3), torch.randn(5))
    b = _with_grads(a[0].grad, a[1].grad)
    ours = clip_grad_norm_(a, 0.5)
    theirs = torch.nn.utils.clip_grad_norm_(b, 0.5)
    torch.testing.assert_close(ours, theirs)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad)


def test_clip_grad_norm_below_threshold_and_disabled():
    ps = _with_grads(torch.tensor([0.3, 0.4]))
    assert clip_grad_norm_(ps, max_norm=1.0).item() == pytest.approx(0.5)
    assert torch.equal(ps[0].grad, torch.tensor([0.3, 0.4]))
    ps = _with_grads(torch.tensor([30.0, 40.0]))
    assert clip_grad_norm_(ps, max_norm=0.0).item() == pytest.approx(50.0)
    assert torch.equal(ps[0].grad, torch.tensor([30.0, 40.0]))
    assert get_grad_norm(_with_grads(torch.tensor([-7.0, 2.0])), norm_type=math.inf).item() == 7.0
    assert get_grad_norm([]).item() == 0.0


def test_clip_grad_norm_with_dtensor(tmp_path):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
        w.grad = distribute_tensor(torch.full((4, 2), 1.5), mesh, [Shard(0)])
        plain = _with_grads(torch.tensor([2.0]))
        norm = clip_grad_norm_([w, plain[0]], max_norm=1.0)
        expected = math.sqrt(8 * 1.5**2 + 4.0)
        assert not hasattr(norm, "device_mesh") and norm.item() == pytest.approx(expected)
        coef = 1.0 / (expected + 1e-6)
        torch.testing.assert_close(w.grad.full_tensor(), torch.full((4, 2), 1.5 * coef))
        torch.testing.assert_close(plain[0].grad, torch.tensor([2.0 * coef]))
        decay, no_decay = build_param_groups(nn.ParameterDict({"w": w}), OptimizerConfig())
        assert len(decay["params"]) == 1 and not no_decay["params"]   # DTensor ndim is the global ndim
    finally:
        dist.destroy_process_group()


def test_decoupled_lr_gives_embedding_and_output_layer_their_own_schedule():
    from megatrain.models.gpt.config import GPTConfig
    from megatrain.models.gpt import GPTModel

    model = GPTModel(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32,
                               untie_embeddings_and_output_weights=True))
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3, min_lr=1e-5, decoupled_lr=5e-3, decoupled_min_lr=4e-4))
    names = {id(p): n for n, p in model.named_parameters()}
    decoupled = [g for g in opt.param_groups if g["is_decoupled_lr"]]
    assert sorted(names[id(p)] for g in decoupled for p in g["params"]) == [
        "embedding.word_embeddings.weight", "output_layer.weight"]
    assert all(g["max_lr"] == 5e-3 and g["min_lr"] == 4e-4 and g["wd_mult"] == 1.0 for g in decoupled)
    sched = LRScheduler(opt, LRScheduleConfig(lr=1e-3, min_lr=1e-5, lr_decay_style="linear", lr_decay_steps=10))
    for _ in range(5):
        sched.step(1)
    lrs = {g["is_decoupled_lr"]: g["lr"] for g in opt.param_groups}
    assert lrs[False] == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))
    assert lrs[True] == pytest.approx(4e-4 + 0.5 * (5e-3 - 4e-4))
    with pytest.raises(ValueError, match="--decoupled-min-lr needs --decoupled-lr"):
        OptimizerConfig(decoupled_min_lr=1e-4)
    plain = build_optimizer(model, OptimizerConfig(lr=1e-3))
    assert not any(g["is_decoupled_lr"] for g in plain.param_groups)
