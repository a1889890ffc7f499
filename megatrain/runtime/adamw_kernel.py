"""A Triton kernel for one AdamW step of one float32 parameter, with the gradient's divisor applied as
it is read and, optionally, the updated weight's half-precision copy written in the same pass.

torch's fused AdamW takes the clipping divisor as ``grad_scale`` but then also writes the divided
gradient back (4 bytes a parameter, ~2.9 ms a step at LLaMA-1.2B on an H100), and the
gradient-accumulation fusion's bf16 weight copies need a pass of their own that reads every weight
again (``GradAccumulationFusion.refresh``). :func:`adamw_step_` reads p, g, m, v once and writes p, m,
v and, where given, the bf16 copy: 30 bytes a fused weight against 32 + 6.

The maths is torch's fused AdamW's (decoupled weight decay): ``p -= lr * wd * p``;
``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2``; ``p -= lr / (1 - b1^t) * m / (sqrt(v) /
sqrt(1 - b2^t) + eps)``, with ``g`` the gradient divided by ``grad_scale`` and ``t`` the step count
read from its device tensor; nothing changes where ``found_inf`` is non-zero. It runs on CUDA, and on
the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, how the tests check it).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Sequence

import torch

from megatrain.triton_support import kernel_available

__all__ = ["kernel_available", "adamw_step_", "KernelAdamW"]

BLOCK = 2048
WARPS = 8


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(P, G, M, V, H, STEP, SCALE, FOUND_INF, n, lr, beta1, beta2, eps, weight_decay,
                     HAS_HALF: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                     BLOCK: tl.constexpr):
        if HAS_FOUND_INF:  # a skipped step: nothing is stored (a scalar branch: the accesses stay vectorized)
            if tl.load(FOUND_INF) != 0:
                return
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        p = tl.load(P + offs, mask=inside, other=0.0)
        g = tl.load(G + offs, mask=inside, other=0.0).to(tl.float32)
        m = tl.load(M + offs, mask=inside, other=0.0)
        v = tl.load(V + offs, mask=inside, other=0.0)
        if HAS_SCALE:
            g = g / tl.load(SCALE)
        t = tl.load(STEP)
        bias_correction1 = 1.0 - tl.exp(t * tl.log(beta1))
        bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp(t * tl.log(beta2)))
        p = p - lr * weight_decay * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.sqrt(v) / bias_correction2_sqrt + eps
        p = p - (lr / bias_correction1) * m / denom
        tl.store(P + offs, p, mask=inside)
        tl.store(M + offs, m, mask=inside)
        tl.store(V + offs, v, mask=inside)
        if HAS_HALF:
            tl.store(H + offs, p.to(H.dtype.element_ty), mask=inside)

    return triton, adamw_kernel


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                step: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                half: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None,
                found_inf: torch.Tensor | None = None) -> None:
    """One AdamW step of ``param`` in place (float32, contiguous; ``exp_avg``/``exp_avg_sq`` likewise,
    ``grad`` float32 or half precision of the same shape), ``step`` the 0-dim float32 step count
    already advanced for this step; ``half``: also write the updated weight into it (contiguous, bf16
    or fp16); ``grad_scale``/``found_inf``: 0-dim float32 device tensors (divide the gradient by the
    first; change nothing where the second is non-zero)."""
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
                    ("half", half)):
        assert t is None or (t.is_contiguous() and t.shape == param.shape), f"{name}: contiguous, param's shape"
    assert param.dtype == exp_avg.dtype == exp_avg_sq.dtype == torch.float32, "float32 weights and moments"
    triton, kernel = _kernel()
    n = param.numel()
    if n == 0:
        return
    kernel[(triton.cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, half if half is not None else param, step,
        grad_scale if grad_scale is not None else step, found_inf if found_inf is not None else step,
        n, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        HAS_HALF=half is not None, HAS_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
        BLOCK=BLOCK, num_warps=WARPS)


class KernelAdamW(torch.optim.AdamW):
    """torch's AdamW (decoupled weight decay; its state dict and parameter groups) whose step runs
    :func:`adamw_step_` for each parameter: the clipping divisor (``grad_scale``, set by the trainer
    as for torch's fused kernels) is applied without writing the gradients back, a step is skipped on
    the device where ``found_inf`` is set, and the weights registered by :meth:`set_half_copies` have
    their half-precision copies written from the updated weights in the same pass.

    Built with ``fused=True`` so that the trainer treats it as a fused optimizer (the step queued
    without a host decision); torch's fused kernel itself never runs. Float32, contiguous parameters
    on a device the kernel runs on (:func:`kernel_available`)."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        for key in ("amsgrad", "maximize", "capturable", "differentiable"):
            if kwargs.get(key):
                raise ValueError(f"KernelAdamW does not implement {key}")
        kwargs["fused"], kwargs["foreach"] = True, None
        super().__init__(params, **kwargs)
        if not self.applies_to([p for group in self.param_groups for p in group["params"]]):
            raise ValueError("KernelAdamW: float32 contiguous parameters, not sharded, on a device the kernel "
                             "runs on")
        self._halves: dict[torch.Tensor, torch.Tensor] = {}
        self._written: dict[torch.Tensor, tuple[int, int]] = {}

    @staticmethod
    def applies_to(params: Sequence[torch.Tensor]) -> bool:
        """Whether it can step ``params``: float32, contiguous, plain tensors (not DTensors) on a device
        the kernel runs on."""
        return all(p.dtype == torch.float32 and p.is_contiguous() and not hasattr(p, "device_mesh")
                   and kernel_available(p.device) for p in params)

    def set_half_copies(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The (parameter, half-precision copy) pairs to write at every step (replacing the previous)."""
        self._halves = {p: h for p, h in pairs}
        self._written = {}

    def copies_current(self, params: Sequence[torch.Tensor], halves: Sequence[torch.Tensor]) -> bool:
        """Whether each of ``halves`` holds its parameter's value as the last step wrote it: registered,
        written by a step, and the parameter not changed since (its version counter and storage)."""
        return all(self._halves.get(p) is h and self._written.get(p) == (p._version, p.data_ptr())
                   for p, h in zip(params, halves))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is None, "KernelAdamW.step takes no closure"
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if not state:  # torch's fused AdamW's state: a float32 step count on the device
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            steps = [self.state[p]["step"] for p in params]
            torch._foreach_add_(steps, 1.0)
            if found_inf is not None:  # a skipped step does not count (as torch's fused kernels)
                torch._foreach_sub_(steps, [found_inf] * len(steps))
            beta1, beta2 = group["betas"]
            for p, step in zip(params, steps):
                state = self.state[p]
                half = self._halves.get(p)
                adamw_step_(p, p.grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], step, lr=float(group["lr"]),
                            beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                            half=half, grad_scale=grad_scale, found_inf=found_inf)
                if half is not None:
                    self._written[p] = (p._version, p.data_ptr())
