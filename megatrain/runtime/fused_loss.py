"""Output layer + cross entropy without the full float32 logits: the per-token loss in chunks.

The plain head computes ``logits = h @ W^T`` for every token ([N, V] in the compute dtype), then
casts them to float32 for the cross entropy, which keeps float32 log-probabilities for the
backward and builds float32 gradients of the same size: for a 131k vocabulary and 8k tokens that
is several 4 GiB tensors alive at once.

:class:`ChunkedCrossEntropy` does the same maths with one tensor of that size, in the compute
dtype:

forward
    ``logits = h @ W^T`` as one matmul (compute dtype, e.g. bf16 under autocast). Then, chunk by
    chunk of ``chunk_size`` tokens, the float32 ``logsumexp`` and target logit give the loss
    ``lse - logit[target]``. Kept for the backward: the logits, ``lse`` (float32 [N]), labels.
backward
    Chunk by chunk, ``(softmax - onehot(target)) * grad_loss`` in float32, written over the
    chunk's logits in the compute dtype; then ``grad_h = G @ W`` and ``grad_W = G^T @ h`` as two
    matmuls, exactly as the plain head's backward does them.

So the matmuls are the plain head's (no recomputation, same sizes and dtypes), and float32 exists
only for one chunk at a time. With ``compile=True`` the float32 work runs as fused torch.compile
kernels (one read of the logits in the forward, one read and write in the backward) that keep the
float32 values in registers, so they take all rows in one call.
Labels equal to ``ignore_index`` give a loss of 0 and no gradient, as with ``F.cross_entropy``.

The logits buffer is overwritten by the backward, so a graph through this function can be
back-propagated once (``retain_graph`` is refused with a clear error).

With ``MEGATRAIN_FP8_OUTPUT_LAYER=1`` the three matmuls run in fp8 instead
(:mod:`megatrain.runtime.fp8_head`, an experiment); the chunked float32 work is this module's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megatrain.compiler_disable import compiler_disable
from megatrain.runtime.grad_accumulation_fusion import wgrad_float32

__all__ = ["ChunkedCrossEntropy", "backward_once", "chunk_kernel", "chunked_cross_entropy", "compute_dtype",
           "logits_grad_in_chunks_", "losses_in_chunks"]


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on ``t`` runs in here: autocast's when it is on for t's device, else t's."""
    device_type = t.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return t.dtype


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 logits."""
    return torch.promote_types(dtype, torch.float32)


# ---- the per-chunk float32 work (plain functions: torch.compile fuses each into a kernel or two) ----

def _chunk_loss(logits_c: torch.Tensor, target_c: torch.Tensor, ignore_index: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] (any float dtype), target [n] -> (loss [n], lse [n]) in float32 (or float64)."""
    x = logits_c.to(_stats_dtype(logits_c.dtype))
    lse = torch.logsumexp(x, dim=-1)
    keep = target_c != ignore_index
    safe = torch.where(keep, target_c, torch.zeros_like(target_c))
    target_logit = x.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    loss = torch.where(keep, lse - target_logit, torch.zeros_like(lse))
    return loss, lse


def _chunk_grad_(logits_c: torch.Tensor, lse_c: torch.Tensor, target_c: torch.Tensor, grad_c: torch.Tensor,
                 ignore_index: int) -> None:
    """Overwrite one chunk's logits with d loss / d logits times the incoming per-token gradient."""
    keep = target_c != ignore_index
    g = torch.where(keep, grad_c.to(lse_c.dtype), torch.zeros_like(lse_c))
    probs = torch.exp(logits_c.to(lse_c.dtype) - lse_c.unsqueeze(-1))
    columns = torch.arange(logits_c.shape[-1], device=logits_c.device)
    onehot = columns.unsqueeze(0) == target_c.unsqueeze(-1)  # ignored targets (-100) match no column
    grad = torch.where(onehot, probs - 1.0, probs) * g.unsqueeze(-1)
    logits_c.copy_(grad)  # in place: compiled, one kernel reads and writes the chunk


def _chunk_shard_stats(logits_c: torch.Tensor, local_target_c: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of a vocabulary shard: (row max, sum of exp(x - max), target logit or 0) in float32.

    ``local_target_c`` is the target's column in this shard, or -1 when the target lies elsewhere.
    """
    x = logits_c.to(_stats_dtype(logits_c.dtype))
    row_max = x.amax(dim=-1)
    sum_exp = torch.exp(x - row_max.unsqueeze(-1)).sum(dim=-1)
    in_shard = local_target_c >= 0
    safe = torch.where(in_shard, local_target_c, torch.zeros_like(local_target_c))
    target_logit = torch.where(in_shard, x.gather(-1, safe.unsqueeze(-1)).squeeze(-1), torch.zeros_like(row_max))
    return row_max, sum_exp, target_logit


_COMPILED: dict[str, Callable[..., Any]] = {}
_KERNELS = {"loss": _chunk_loss, "grad": _chunk_grad_, "shard_stats": _chunk_shard_stats}


def chunk_kernel(name: str, compile: bool) -> Callable[..., Any]:
    """A per-chunk function of this module ("loss", "grad", "shard_stats"), compiled on request."""
    if not compile:
        return _KERNELS[name]
    if name not in _COMPILED:
        # dynamic=False: a chunk has at most two shapes (full chunks and the remainder).
        _COMPILED[name] = torch.compile(_KERNELS[name], dynamic=False)
    return _COMPILED[name]


def _kernels(compile: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    return chunk_kernel("loss", compile), chunk_kernel("grad", compile)


def _rows_per_call(n: int, chunk_size: int, compile: bool) -> int:
    """Rows of the logits per call of the per-chunk work. Compiled, each call is one fused kernel
    that converts to float32 in registers (no float32 copy exists at any chunk size), so all rows go
    in one call: one launch instead of one host round trip per chunk. Eager, ``chunk_size``."""
    return max(n, 1) if compile else chunk_size


def losses_in_chunks(logits: torch.Tensor, target: torch.Tensor, chunk_size: int, ignore_index: int,
                     compile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token loss and log-sum-exp (float32, or float64 for float64 logits) of ``logits`` [N, V]
    against ``target`` [N], computed chunk by chunk."""
    loss_fn, _ = _kernels(compile)
    n = logits.shape[0]
    loss = torch.empty(n, dtype=_stats_dtype(logits.dtype), device=logits.device)
    lse = torch.empty_like(loss)
    step = _rows_per_call(n, chunk_size, compile)
    for start in range(0, n, step):
        end = min(start + step, n)
        loss[start:end], lse[start:end] = loss_fn(logits[start:end], target[start:end], ignore_index)
    return loss, lse


def logits_grad_in_chunks_(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, grad_loss: torch.Tensor,
                           chunk_size: int, ignore_index: int, compile: bool) -> None:
    """Overwrite ``logits`` with d loss / d logits times ``grad_loss``, chunk by chunk."""
    _, grad_fn = _kernels(compile)
    n = logits.shape[0]
    step = _rows_per_call(n, chunk_size, compile)
    for start in range(0, n, step):
        end = min(start + step, n)
        grad_fn(logits[start:end], lse[start:end], target[start:end], grad_loss[start:end], ignore_index)


def backward_once(ctx: Any, what: str) -> None:
    """Refuse a second backward through a loss whose backward overwrites its saved logits."""
    if getattr(ctx, "used", False):
        raise RuntimeError(f"{what} overwrites its saved logits in the backward: its graph cannot be "
                           "back-propagated twice (retain_graph); use --cross-entropy-chunk-size 0")
    ctx.used = True


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """hidden [N, h], weight [V, h], target [N] -> per-token loss [N] float32 (see the module doc)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk_size: int,
                ignore_index: int, dtype: torch.dtype, compile: bool, half_weight: torch.Tensor | None = None,
                prev_grad: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        h = hidden.to(dtype)
        w = weight.to(dtype) if half_weight is None else half_weight
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            logits = h @ w.t() if bias is None else torch.addmm(bias.to(dtype), h, w.t())  # [N, V], compute dtype
            loss, lse = losses_in_chunks(logits, target, chunk_size, ignore_index, compile)
        ctx.save_for_backward(h, w, logits, lse, target, prev_grad)
        ctx.config = (chunk_size, ignore_index, compile, hidden.dtype, weight.dtype, half_weight is not None)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:
        backward_once(ctx, "the chunked cross entropy")
        chunk_size, ignore_index, compile, hidden_dtype, weight_dtype, fused = ctx.config
        h, w, logits, lse, target, prev_grad = ctx.saved_tensors
        grad_loss = grad_loss.contiguous()
        grad_hidden = grad_weight = grad_bias = None
        with torch.autocast(device_type=logits.device.type, enabled=False):
            logits_grad_in_chunks_(logits, lse, target, grad_loss, chunk_size, ignore_index, compile)
            grad_logits = logits  # now d loss / d logits, in the compute dtype
            if ctx.needs_input_grad[0]:
                grad_hidden = (grad_logits @ w).to(hidden_dtype)
            if ctx.needs_input_grad[1] and fused:  # float32 weight gradient, added to the staged one
                grad_weight = wgrad_float32(prev_grad, grad_logits, h).to(weight_dtype)
            elif ctx.needs_input_grad[1]:
                grad_weight = (grad_logits.t() @ h).to(weight_dtype)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[9]:
                grad_bias = grad_logits.sum(0, dtype=_stats_dtype(grad_logits.dtype)).to(ctx.bias_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, grad_bias


# labeled_rows_only: below this share of labeled rows the gather of those rows pays for itself
LABELED_ROWS_WORTH_GATHERING = 0.9


def _labeled_rows(labels: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """The flat indices of the rows with a label, where they are few enough to compute alone (one
    device-to-host synchronisation for their count); None to compute every row (also while a CUDA graph
    is being recorded, where a data-dependent size cannot be)."""
    if labels.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    rows = (labels.reshape(-1) != ignore_index).nonzero().squeeze(1)
    return rows if rows.numel() < LABELED_ROWS_WORTH_GATHERING * labels.numel() else None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                          *, ignore_index: int = -100, compile: bool = False, half_weight: torch.Tensor | None = None,
                          prev_grad: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                          labeled_rows_only: bool = False, fp8: Any = None) -> torch.Tensor:
    """Per-token ``cross_entropy(hidden @ weight.T, labels)`` in float32, shaped like ``labels``.

    hidden [..., h] (after the final norm), weight [V, h] (the output layer or the tied word
    embeddings), labels [...]. The matmuls run in autocast's dtype when autocast is on (else in
    hidden's dtype); the softmax statistics in float32, ``chunk_size`` tokens at a time. ``bias`` [V]:
    the output layer's bias (BERT's), added to the logits.
    ``half_weight``: a compute-dtype copy of ``weight`` to use instead of casting it; then the weight
    gradient is ``prev_grad + G^T h`` in float32 from one matmul (gradient-accumulation fusion,
    :mod:`megatrain.runtime.grad_accumulation_fusion`).
    ``labeled_rows_only``: where most labels are ``ignore_index`` (an image's positions, a prompt), the
    output layer and the loss run on the labeled rows alone (gathered; their losses scattered back, the
    other rows 0 with no gradient, as before). The same maths; it costs one synchronisation for the count.
    ``fp8``: the output weight's fp8 copies (:class:`megatrain.runtime.fp8_head.Fp8HeadWeights`, refreshed):
    the three matmuls in fp8 (no bias).
    """
    if chunk_size <= 0:
        raise ValueError(f"--cross-entropy-chunk-size must be positive for the chunked loss, got {chunk_size}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not match")
    rows_h, rows_t = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    rows = _labeled_rows(labels, ignore_index) if labeled_rows_only else None
    if rows is not None:
        rows_h, rows_t = rows_h.index_select(0, rows), rows_t.index_select(0, rows)
    dtype = compute_dtype(hidden) if half_weight is None else half_weight.dtype
    if fp8 is not None:
        assert bias is None and fp8.w8 is not None, "the fp8 output layer: refreshed weights, no bias"
        from megatrain.runtime.fp8_head import chunked_fp8_cross_entropy  # (it builds on this module)

        flat = chunked_fp8_cross_entropy(rows_h, weight, rows_t, chunk_size, ignore_index, dtype, compile, fp8,
                                         prev_grad)
    else:
        flat = _ChunkedLinearCrossEntropy.apply(rows_h, weight, rows_t, int(chunk_size), int(ignore_index), dtype,
                                                bool(compile), half_weight, prev_grad, bias)
    if rows is not None:
        flat = flat.new_zeros(labels.numel()).index_copy(0, rows, flat)
    return flat.view(labels.shape)


@dataclass
class ChunkedCrossEntropy:
    """The chunked float32 loss head (a model's ``loss_head`` under ``--cross-entropy-chunk-size``).

    chunk_size: tokens per float32 chunk (``--cross-entropy-chunk-size``); compile: run the
    per-chunk work as torch.compile kernels (set with ``--use-torch-compile`` on CUDA).
    ``half_weight`` / ``main_grad_in``: set by the gradient-accumulation fusion
    (:class:`megatrain.runtime.grad_accumulation_fusion.GradAccumulationFusion`) for the output weight.
    """

    chunk_size: int = 1024
    compile: bool = False
    labeled_rows_only: bool = False  # see chunked_cross_entropy (models whose labels are mostly ignored)
    half_weight: torch.Tensor | None = field(default=None, repr=False, compare=False)
    main_grad_in: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # the output layer in fp8 (megatrain.runtime.fp8_head.Fp8HeadWeights; MEGATRAIN_FP8_OUTPUT_LAYER=1):
    # the fusion refreshes its copies once per step; used once they exist and the layer has no bias
    fp8_weights: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ValueError(f"--cross-entropy-chunk-size must be positive (0 turns the chunked loss off), "
                             f"got {self.chunk_size}")

    def per_token_loss(self, model: Any, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss-head protocol (:mod:`megatrain.models.common.heads`): ``model.output_weight()`` and
        ``model.output_bias()``."""
        return self(hidden, model.output_weight(), labels, model.output_bias())

    @compiler_disable  # a whole-model compile stops here: the chunks run their own kernels
    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        fp8 = self.fp8_weights
        fp8 = fp8 if fp8 is not None and fp8.w8 is not None and bias is None else None
        return chunked_cross_entropy(hidden, weight, labels, self.chunk_size, compile=self.compile,
                                     half_weight=self.half_weight, prev_grad=self.main_grad_in, bias=bias,
                                     labeled_rows_only=self.labeled_rows_only, fp8=fp8)
