"""megatrain's AdamW kernel (runtime/adamw_kernel.py), run by Triton's interpreter on the CPU: torch's
AdamW maths, the clipping divisor without a gradient write-back, skipped steps, the bf16 weight copies
written in the same pass (and the gradient-accumulation fusion's refresh skipped after them), torch's
state dict; then a bf16 training run through it against torch's fused AdamW."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = r"""
import copy
import torch
from megatrain.runtime.adamw_kernel import KernelAdamW, adamw_step_, kernel_available
from megatrain.runtime.grad_accumulation_fusion import GradAccumulationFusion, convert_linears
from megatrain.optimizer import OptimizerConfig, build_optimizer, build_param_groups, folds_grad_divisor

assert kernel_available(torch.device("cpu"))
torch.manual_seed(0)

# 1. one tensor: torch's AdamW (the gradient divided first), a divisor, a skipped step, the bf16 copy
for n, divisor, wd in [(5000, None, 0.1), (3, 2.5, 0.0), (4100, 0.7, 0.01)]:
    p = torch.randn(n)
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, foreach=False)
    m, v, step = torch.zeros(n), torch.zeros(n), torch.zeros(())
    half = torch.empty(n, dtype=torch.bfloat16)
    for it in range(4):
        g = torch.randn(n)
        skip = it == 2
        found = torch.tensor(1.0 if skip else 0.0)
        step += 0.0 if skip else 1.0
        g_before = g.clone()
        adamw_step_(p, g, m, v, step, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd, half=half,
                    grad_scale=None if divisor is None else torch.tensor(divisor), found_inf=found)
        assert torch.equal(g, g_before), "the gradient is not written back"
        if not skip:
            ref.grad = g if divisor is None else g / divisor
            opt.step()
        err = ((p - ref.detach()).abs().max() / ref.detach().abs().max()).item()
        assert err < 1e-6, (n, it, err)
        # the copy: the updated weight in bf16 (the interpreter may round toward zero: one bf16 step)
        assert ((half.float() - p).abs() <= p.abs() * 2 ** -7 + 1e-30).all()
    st = opt.state[ref]
    assert ((m - st["exp_avg"]).abs().max() / st["exp_avg"].abs().max()).item() < 1e-6
    assert ((v - st["exp_avg_sq"]).abs().max() / st["exp_avg_sq"].abs().max()).item() < 1e-6

# 2. the optimizer: Megatron's groups, the trainer's grad_scale/found_inf protocol, torch's state dict
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
ref_model = copy.deepcopy(model)
cfg = OptimizerConfig(lr=3e-3, weight_decay=0.1, adam_beta2=0.95, adamw_kernel=True)
opt = build_optimizer(model, cfg)
assert isinstance(opt, KernelAdamW) and folds_grad_divisor(opt, list(model.parameters()))
ref_opt = build_optimizer(ref_model, OptimizerConfig(lr=3e-3, weight_decay=0.1, adam_beta2=0.95, fused=False,
                                                     foreach=False))
assert type(ref_opt) is torch.optim.AdamW
for it in range(4):
    x = torch.randn(5, 16)
    for mdl in (model, ref_model):
        mdl.zero_grad(set_to_none=True)
        mdl(x).square().sum().backward()
    divisor = torch.tensor(1.5 + it)
    opt.grad_scale, opt.found_inf = divisor, torch.tensor(1.0 if it == 1 else 0.0)
    opt.step()
    del opt.grad_scale, opt.found_inf
    if it != 1:
        for p in ref_model.parameters():
            p.grad /= divisor
        ref_opt.step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert ((a - b).abs().max() / b.abs().max()).item() < 2e-6, it
sd = opt.state_dict()
assert sd["state"][0].keys() == ref_opt.state_dict()["state"][0].keys()
assert float(sd["state"][0]["step"]) == 3.0
again = build_optimizer(model, cfg)
again.load_state_dict(sd)
assert float(again.state[next(model.parameters())]["step"]) == 3.0

# 3. the fusion's bf16 copies: written by the step, so refresh copies nothing until a weight changes
torch.manual_seed(1)
net = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 16))
fusion = GradAccumulationFusion(convert_linears(net.modules()), torch.bfloat16)
opt = build_optimizer(net, cfg)
fusion.copier = opt
calls = []
real_copy = torch._foreach_copy_
torch._foreach_copy_ = lambda *a, **k: (calls.append(1), real_copy(*a, **k))[1]
for it in range(3):
    net.zero_grad(set_to_none=True)
    fusion.refresh()
    fusion.stage(fresh=True)
    loss = net(torch.randn(4, 24)).square().sum()
    fusion.release()
    loss.backward()
    opt.step()
    for m in fusion.linears:
        assert ((m.half_weight.float() - m.weight).abs() <= m.weight.abs() * 2 ** -7 + 1e-30).all()
assert len(calls) == 1, calls  # only the first refresh copied
with torch.no_grad():
    net[0].weight.mul_(0.5)  # a weight changed outside the optimizer (as a loaded checkpoint)
fusion.refresh()
assert len(calls) == 2 and torch.equal(net[0].half_weight, net[0].weight.to(torch.bfloat16))
fusion.drop_half_weights()
assert opt._halves == {}
torch._foreach_copy_ = real_copy
print("adamw kernel ok")
"""


def _interpreted(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """``python *args`` in a fresh process with Triton's interpreter (set before Triton is imported)."""
    pytest.importorskip("triton")
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), **env))


def test_adamw_kernel_under_the_interpreter():
    proc = _interpreted(["-c", CHECK])
    assert proc.returncode == 0 and "adamw kernel ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


RUN = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
       "64", "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "4",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--eval-iters", "0",
       "--device", "cpu", "--train-iters", "8", "--lr", "3e-3", "--lr-warmup-iters", "2", "--bf16",
       "--no-torch-compile", "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
       "--clip-grad", "0.05"]


def _losses(kernel: str) -> list[tuple[float, float]]:
    from megatrain.training.logging import parse_train_log_line

    proc = _interpreted(RUN, MEGATRAIN_ADAMW_KERNEL=kernel)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    said = "AdamW: megatrain's Triton kernel (MEGATRAIN_ADAMW_KERNEL=1)" in proc.stdout
    assert said == (kernel == "1"), proc.stdout[-3000:]
    lines = [parse_train_log_line(line) for line in proc.stdout.splitlines() if "] iteration " in line]
    return [(d["lm loss"], d["grad norm"]) for d in lines]


def test_training_through_the_kernel_follows_torchs_fused_adamw():
    """bf16 (the gradient-accumulation fusion on), one micro-batch, clipping active (--clip-grad 0.05):
    the same losses and gradient norms as torch's fused AdamW, to bf16's tolerance."""
    plain, kernel = _losses("0"), _losses("1")
    assert len(plain) == len(kernel) == 8
    for step, ((lp, gp), (lk, gk)) in enumerate(zip(plain, kernel), start=1):
        assert abs(lk - lp) <= 2e-3 * abs(lp), (step, lp, lk)
        assert abs(gk - gp) <= 2e-2 * abs(gp) + 1e-3, (step, gp, gk)


def test_a_bad_adamw_kernel_choice_is_one_line():
    env = dict(os.environ, MEGATRAIN_ADAMW_KERNEL="yes", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, *RUN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "MEGATRAIN_ADAMW_KERNEL must be 0 or 1, got 'yes'" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.gpu
def test_kernel_adamw_on_cuda_follows_torchs_fused_adamw():
    """On CUDA: KernelAdamW against torch's fused AdamW over a few steps with a clipping divisor and one
    skipped step; the bf16 copies equal the updated weights rounded to bf16."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    from megatrain.optimizer import OptimizerConfig, build_optimizer
    from megatrain.runtime.adamw_kernel import KernelAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1536), torch.nn.LayerNorm(1536), torch.nn.Linear(1536, 256)).cuda()
    ref = [p.detach().clone().requires_grad_() for p in model.parameters()]
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.1, adam_beta2=0.95, adamw_kernel=True))
    assert isinstance(opt, KernelAdamW)
    # the same parameter groups (Megatron's: no weight decay on biases and norms)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    ref_groups = [{"params": [ref[index[id(p)]] for p in g["params"]], "weight_decay": g["weight_decay"]}
                  for g in opt.param_groups]
    assert {g["weight_decay"] for g in ref_groups} == {0.0, 0.1}
    ref_opt = torch.optim.AdamW(ref_groups, lr=1e-3, betas=(0.9, 0.95), fused=True)
    halves = [torch.empty_like(p, dtype=torch.bfloat16) for p in model.parameters()]
    opt.set_half_copies(zip(model.parameters(), halves))
    for it in range(4):
        grads = [torch.randn_like(p) for p in ref]
        for p, r, g in zip(model.parameters(), ref, grads):
            p.grad, r.grad = g.clone(), g.clone()
        divisor, found = torch.tensor(1.7, device="cuda"), torch.tensor(float(it == 2), device="cuda")
        for o in (opt, ref_opt):
            o.grad_scale, o.found_inf = divisor, found
            o.step()
            del o.grad_scale, o.found_inf
        for p, r, h in zip(model.parameters(), ref, halves):
            assert ((p - r).abs().max() / r.abs().max()).item() < 1e-6, it
            assert torch.equal(h, p.detach().to(torch.bfloat16)), it


def test_the_benchmark_prints_torchs_row_and_one_per_kernel_setting():
    proc = _interpreted(["benchmarks/adamw_kernel.py", "--shape", "tiny", "--steps", "2", "--blocks", "2048x8",
                         "1024x4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| AdamW + foreach_copy_ refresh |" in proc.stdout
    for setting in ("2048 x 8 warps", "1024 x 4 warps"):
        assert f"| KernelAdamW (copies in the step; {setting}) |" in proc.stdout, setting


def test_the_kernel_is_the_default_on_cuda_for_large_models_only(monkeypatch):
    """Unset MEGATRAIN_ADAMW_KERNEL (None): the kernel on CUDA from KERNEL_ADAMW_MIN_PARAMETERS on; 0 never;
    never on the CPU by default (Triton's interpreter is for tests)."""
    import torch

    import megatrain.optimizer as opt_mod
    from megatrain.optimizer import OptimizerConfig, build_optimizer
    from megatrain.runtime.adamw_kernel import KernelAdamW
    from megatrain.training.run_config import adamw_kernel_from_env

    for value, want in (("", None), ("0", False), ("1", True)):
        monkeypatch.setenv("MEGATRAIN_ADAMW_KERNEL", value)
        assert adamw_kernel_from_env() is want
    model = torch.nn.Linear(64, 64)
    monkeypatch.setattr(opt_mod, "KERNEL_ADAMW_MIN_PARAMETERS", 1)
    assert not isinstance(build_optimizer(model, OptimizerConfig()), KernelAdamW)  # CPU
    if torch.cuda.is_available() and kernel_available(torch.device("cuda")):
        model = model.cuda()
        assert isinstance(build_optimizer(model, OptimizerConfig()), KernelAdamW)
        assert not isinstance(build_optimizer(model, OptimizerConfig(adamw_kernel=False)), KernelAdamW)
        monkeypatch.setattr(opt_mod, "KERNEL_ADAMW_MIN_PARAMETERS", 1 << 27)
        assert not isinstance(build_optimizer(model, OptimizerConfig()), KernelAdamW)  # small: torch's
