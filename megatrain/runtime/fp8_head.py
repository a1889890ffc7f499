"""The output layer in fp8 (an experiment, ``MEGATRAIN_FP8_OUTPUT_LAYER=1`` with ``--fp8-format``; off
by default, as in Megatron, whose fp8 covers the transformer layers only).

The output layer of a language model is a large share of its matmuls (LLaMA-1.2B: 21 % of the weight
matmuls' multiply-adds), and ``--fp8-format`` leaves it in bf16. Here the chunked loss head
(:mod:`megatrain.runtime.fused_loss`) runs its three matmuls in fp8 with the recipe of megatrain's fp8
layers (:mod:`megatrain.runtime.fp8_fusion`): the hidden states in e4m3 with a per-tensor scale, the
weight cast once per optimizer step in both layouts (:class:`Fp8HeadWeights`, refreshed by the
gradient-accumulation fusion), the logits' gradient in the format's gradient dtype (e5m2 for hybrid),
the weight gradient in float32 added in place. The float32 loss and its gradient are the chunked
head's own. What it risks: the logits' gradient (softmax minus one-hot) spans many orders of magnitude
in one tensor, kept at e5m2's two mantissa bits under one scale; its loss curve against bf16 decides.

Row counts that are not a multiple of 16 get rows with ignored labels appended (loss 0, no gradient).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatrain.runtime.fp8_fusion import E4M3, _pad_rows, cast_weight_copies, quantize, weight_grad
from megatrain.runtime.fused_loss import backward_once, logits_grad_in_chunks_, losses_in_chunks

__all__ = ["Fp8HeadWeights", "chunked_fp8_cross_entropy"]

class Fp8HeadWeights:
    """The output weight's fp8 copies (row-major for the logits, transposed for the hidden states'
    gradient) and inverse scale, cast once per optimizer step into fixed buffers."""

    def __init__(self, grad_dtype: torch.dtype, compile_cast: bool) -> None:
        self.grad_dtype = grad_dtype
        self.compile_cast = compile_cast
        self.w8: torch.Tensor | None = None
        self.w8_t: torch.Tensor | None = None
        self.inv: torch.Tensor | None = None

    @torch.no_grad()
    def refresh(self, weight: torch.Tensor) -> None:
        held = None if self.w8 is None else (self.w8, self.w8_t, self.inv)
        self.w8, self.w8_t, self.inv = cast_weight_copies(weight, held, self.compile_cast)

    def drop(self) -> None:
        self.w8 = self.w8_t = self.inv = None


_COMPILED_QUANTIZE: list[Any] = []


def _quantize(t: torch.Tensor, dtype: torch.dtype, compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~megatrain.runtime.fp8_fusion.quantize`, compiled on CUDA when ``compiled`` (eager, its
    absolute value would be a temporary as large as the logits)."""
    if not compiled or t.device.type != "cuda":
        return quantize(t, dtype)
    if not _COMPILED_QUANTIZE:
        _COMPILED_QUANTIZE.append(torch.compile(quantize))
    return _COMPILED_QUANTIZE[0](t, dtype)


class _ChunkedFp8LinearCrossEntropy(torch.autograd.Function):
    """hidden [N, h], weight [V, h], target [N] -> per-token loss [N] float32, the matmuls in fp8."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk_size: int,
                ignore_index: int, dtype: torch.dtype, compile: bool, fp8: Fp8HeadWeights,
                prev_grad: torch.Tensor | None) -> torch.Tensor:
        rows = hidden.shape[0]
        h = _pad_rows(hidden.to(dtype))
        if h.shape[0] > rows:  # the appended rows' labels are ignored
            target = F.pad(target, (0, h.shape[0] - rows), value=ignore_index)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            h8, h_inv = _quantize(h, E4M3, compile)
            logits = torch._scaled_mm(h8, fp8.w8.t(), h_inv, fp8.inv, out_dtype=dtype, use_fast_accum=True)
            loss, lse = losses_in_chunks(logits, target, chunk_size, ignore_index, compile)
        ctx.save_for_backward(h8, h_inv, fp8.w8_t, fp8.inv, logits, lse, target, prev_grad)
        ctx.config = (chunk_size, ignore_index, compile, hidden.dtype, weight.dtype, rows, fp8.grad_dtype, dtype)
        return loss[:rows]

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:
        backward_once(ctx, "the chunked cross entropy")
        chunk_size, ignore_index, compile, hidden_dtype, weight_dtype, rows, grad_dtype, dtype = ctx.config
        h8, h_inv, w8_t, w_inv, logits, lse, target, prev = ctx.saved_tensors
        grad_loss = F.pad(grad_loss.contiguous(), (0, logits.shape[0] - rows))
        grad_hidden = grad_weight = None
        with torch.autocast(device_type=logits.device.type, enabled=False):
            logits_grad_in_chunks_(logits, lse, target, grad_loss, chunk_size, ignore_index, compile)
            g8, g_inv = _quantize(logits, grad_dtype, compile)  # the logits' gradient, now in the logits
            del logits
            if ctx.needs_input_grad[0]:
                grad_hidden = torch._scaled_mm(g8, w8_t.t(), g_inv, w_inv, out_dtype=dtype)[:rows].to(hidden_dtype)
            if ctx.needs_input_grad[1]:
                grad_weight = weight_grad(prev, g8.t().contiguous(), h8.t().contiguous(), g_inv, h_inv, weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def chunked_fp8_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk_size: int,
                              ignore_index: int, dtype: torch.dtype, compile: bool, fp8: Fp8HeadWeights,
                              prev_grad: torch.Tensor | None) -> torch.Tensor:
    """Per-token loss [N] of rows ``hidden`` [N, h] against ``target`` [N] with the fp8 matmuls above."""
    return _ChunkedFp8LinearCrossEntropy.apply(hidden, weight, target, int(chunk_size), int(ignore_index), dtype,
                                               bool(compile), fp8, prev_grad)
