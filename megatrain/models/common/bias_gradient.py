"""Attention with a trained additive bias whose gradient SDPA's fused kernels need not compute.

A T5 layer adds a learned relative-position bias to its scores. Given a float mask that requires a
gradient, PyTorch's SDPA falls back to its memory-efficient kernel in a mode that writes the whole
[b, heads, s, s] score gradient; held to a mask without gradient, it runs its faster kernels.
:func:`attention_with_bias` runs SDPA on the detached mask (queries, keys and values get their
gradients from SDPA's own backward) and gives the bias its gradient through :class:`BiasGradient`, an
identity on the attention output whose backward recomputes the scores once and forms

    dS = P * (dO v^T - rowsum(dO * O)),   P = softmax(q k^T * scale + mask)

summed over the dimensions the bias broadcasts over (the batch, for a bias shared by every sample).
That is the same gradient autograd would give the mask, in float32. On CUDA with Triton, a bias shared
by the batch goes through the kernel of :mod:`megatrain.models.common.bias_gradient_kernel` (tiles of
the gradient summed over the batch in registers, nothing of size batch x heads x s x s), given the
log-sum-exp of the forward when :class:`AttentionWithLogSumExp` ran SDPA's kernel; elsewhere
through PyTorch (scores in the inputs' dtype, as an unfused attention computes them; under inductor
it keeps float32 [b, heads, s, s] intermediates, measured 2.0 ms a T5-base layer on an H100).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class BiasedMask:
    """What a model hands its attention layers in place of a float mask when the mask's additive part
    is trained: ``mask`` (:func:`biased_mask` of the detached bias, the scores' dtype) and ``bias``, the
    tensor it was built from (its gradient comes from :class:`BiasGradient`)."""

    mask: torch.Tensor
    bias: torch.Tensor
    keep: torch.Tensor | None = None  # bool, broadcastable to the scores: False where a key is hidden

    def with_gradient(self) -> torch.Tensor:
        """The mask as one tensor that passes its gradient on to ``bias`` (for paths that cannot
        recompute the scores, such as attention dropout): the same values, one more [b, heads, s, s]
        addition. Where a key is hidden the score gradient is zero, as through ``masked_fill``."""
        return self.mask + (self.bias - self.bias.detach()).to(self.mask.dtype)


class BiasGradient(torch.autograd.Function):
    """``apply(out, q, k, v, bias, keep, scale)`` -> ``out`` unchanged; its backward passes the output
    gradient through and returns the gradient of ``bias`` (the scores' additive part, broadcast to
    their shape; ``keep``: None or bool, False where a key is hidden). The scores are rebuilt from
    ``bias`` and ``keep`` rather than read from the [b, heads, s, s] mask: a bias shared by the batch
    ([1, heads, s, s], float32, a few MB) stays in cache."""

    @staticmethod
    def forward(ctx, out, q, k, v, bias, keep, scale):  # type: ignore[override]
        ctx.save_for_backward(out, q, k, v, bias.detach(), keep)
        ctx.scale = scale
        ctx.bias_shape, ctx.bias_dtype = bias.shape, bias.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        out, q, k, v, bias, keep = ctx.saved_tensors
        if _kernel_applies(q, bias, keep):
            from megatrain.models.common.bias_gradient_kernel import attention_bias_grad

            grad = attention_bias_grad(q, k, v, out, grad_out, bias, keep, ctx.scale).unsqueeze(0)
            return grad_out, None, None, None, _sum_to(grad, ctx.bias_shape).to(ctx.bias_dtype), None, None
        k_, v_ = _repeat_kv(k, q), _repeat_kv(v, q)
        scores = torch.matmul(q, k_.transpose(-1, -2)).float() * ctx.scale + bias.float()
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # rows with every key hidden
        probs = torch.exp(scores - lse)
        grad_probs = torch.matmul(grad_out, v_.transpose(-1, -2)).float()
        rowdot = (grad_out.float() * out.float()).sum(-1, keepdim=True)
        grad_scores = probs * (grad_probs - rowdot)
        return (grad_out, None, None, None, _sum_to(grad_scores, ctx.bias_shape).to(ctx.bias_dtype), None, None)


def _attention_forward(q, k, v, mask, scale):
    """SDPA's kernel for a float mask called directly: (output, log-sum-exp of each score row, what its
    backward needs). CUDA: the memory-efficient kernel (the one SDPA picks for a float mask; its
    log-sum-exp [b, heads, s_q rounded up to 32] padded with +inf); CPU: the flash-style CPU kernel."""
    if q.is_cuda:
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, 0.0, False, scale=scale)
        return out, lse, (seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                         scale=scale)
    return out, lse, ()


def _attention_backward(grad_out, q, k, v, mask, out, lse, extra, scale):
    """q, k and v's gradients from the backward of :func:`_attention_forward`'s kernel."""
    if q.is_cuda:
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, mask, out, lse, *extra, 0.0, [True, True, True, False], False, scale=scale)
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)


class AttentionWithLogSumExp(torch.autograd.Function):
    """``apply(q, k, v, mask, bias, keep, scale)`` -> SDPA's output, computed by the kernel SDPA would
    run for the float mask, called directly so that the forward's log-sum-exp of each score row is
    kept: the backward takes q, k and v's gradients from that kernel's backward and ``bias``'s from
    :func:`~megatrain.models.common.bias_gradient_kernel.attention_bias_grad` given the log-sum-exp,
    which then skips its own pass over the keys. ``mask`` is :func:`biased_mask` of ``bias`` and
    ``keep`` (its values are what the scores add, so the bias goes to the kernel rounded to the mask's
    dtype: its probabilities are the forward's). Where it runs: :func:`_lse_path_applies`."""

    @staticmethod
    def forward(ctx, q, k, v, mask, bias, keep, scale):  # type: ignore[override]
        b, h, m, n = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        mask = mask.detach().expand(b, h, m, n)
        out, lse, extra = _attention_forward(q, k, v, mask, scale)
        ctx.save_for_backward(q, k, v, mask, out, lse, bias.detach(), keep, *extra)
        ctx.scale = scale
        ctx.bias_shape, ctx.bias_dtype = bias.shape, bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        from megatrain.models.common.bias_gradient_kernel import attention_bias_grad

        q, k, v, mask, out, lse, bias, keep, *extra = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq, dk, dv = _attention_backward(grad_out, q, k, v, mask, out, lse, extra, ctx.scale)
        # rounded to the mask's dtype in the one copy that also makes it contiguous for the kernel (the
        # bias every layer shares is saved, not a copy of it per layer)
        bias = bias.expand(1, *mask.shape[1:]).to(mask.dtype, memory_format=torch.contiguous_format)
        grad = attention_bias_grad(q, k, v, out, grad_out, bias, keep, ctx.scale, lse).unsqueeze(0)
        return dq, dk, dv, None, _sum_to(grad, ctx.bias_shape).to(ctx.bias_dtype), None, None


# Whether attention_with_bias keeps the log-sum-exp of SDPA's memory-efficient kernel where it can
# (AttentionWithLogSumExp); False (the default): SDPA, which picks cuDNN's attention for this mask on an H100,
# then the bias-gradient kernel computes the log-sum-exp. Measured on an H100 (2026-12-07, T5-base encoder
# layer, forward and backward): 3.22 ms with the memory-efficient kernel's log-sum-exp against 2.23 ms
# through SDPA: the slower attention kernels cost more than the log-sum-exp pass saves.
SDPA_LOG_SUM_EXP = False


def _lse_path_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor,
                      keep: torch.Tensor | None) -> bool:
    """Whether :class:`AttentionWithLogSumExp` runs: where the bias-gradient kernel applies (CUDA with
    Triton; the CPU under Triton's interpreter), with the shapes and strides the memory-efficient
    kernel takes as they are (head dims and key counts multiples of 8 and 16, unit last strides, a 4-d
    mask of the queries' dtype)."""
    return (SDPA_LOG_SUM_EXP and q.device.type in ("cuda", "cpu") and _kernel_applies(q, bias, keep)
            and mask.dim() == 4 and q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0 and k.shape[-2] % 16 == 0
            and all(t.stride(-1) == 1 for t in (q, k, v, mask))
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and mask.dtype == q.dtype)


def _kernel_applies(q: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor | None) -> bool:
    """Whether the Triton kernel (``bias_gradient_kernel``) computes the gradient: a bias shared by
    the batch and the heads' own ([1, heads, ...]), a keep mask shared by the heads, and the kernel
    available for the device (CUDA with Triton, or Triton's interpreter)."""
    if bias.dim() != 4 or bias.shape[0] != 1 or bias.shape[1] != q.shape[1]:
        return False
    if keep is not None and (keep.dim() != 4 or keep.shape[1] != 1):
        return False
    if q.numel() >= 2**31 or bias.shape[-2] * bias.shape[-1] * q.shape[1] >= 2**31:
        return False  # the kernel's offsets are 32-bit
    from megatrain.models.common.bias_gradient_kernel import kernel_available

    return kernel_available(q.device)


def _repeat_kv(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Keys or values with fewer heads than the queries (grouped-query attention) repeated to match."""
    groups = q.shape[-3] // t.shape[-3]
    return t if groups == 1 else t.repeat_interleave(groups, dim=-3)


def _sum_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``grad`` summed over the leading and size-1 dimensions that ``shape`` broadcasts over."""
    lead = grad.dim() - len(shape)
    if lead:
        grad = grad.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def biased_mask(bias: torch.Tensor, keep: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """An additive mask: ``bias`` with -inf where ``keep`` (bool, broadcastable) is False, in ``dtype``
    (differentiable in ``bias``; give ``bias.detach()`` for the mask of a :class:`BiasedMask`). Build it
    once and hand it to every layer that shares the bias."""
    mask = bias if keep is None else bias.masked_fill(~keep, float("-inf"))
    return mask.to(dtype)


def attention_with_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        bias: torch.Tensor | None = None, keep: torch.Tensor | None = None, *,
                        scale: float | None = None) -> torch.Tensor:
    """SDPA of ``q`` [b, heads, s_q, d], ``k``/``v`` [b, heads_kv, s_k, d] under ``mask`` (from
    :func:`biased_mask` of ``bias`` and ``keep``); when ``bias`` (the trained tensor the mask was built
    from) requires a gradient, it gets one through :class:`BiasGradient` while SDPA runs on the
    detached mask."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # with an explicit mask not every torch >= 2.6 kernel takes enable_gqa: shared key/value heads repeated
    k, v = _repeat_kv(k, q), _repeat_kv(v, q)
    trained = bias is not None and bias.requires_grad and torch.is_grad_enabled()
    if trained and _lse_path_applies(q, k, v, mask, bias, keep):
        return AttentionWithLogSumExp.apply(q, k, v, mask, bias, keep, scale)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.detach(), scale=scale)
    if trained:
        out = BiasGradient.apply(out, q, k, v, bias, keep, scale)
    return out
