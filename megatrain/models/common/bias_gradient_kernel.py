"""A Triton kernel for the gradient of an attention bias shared by the batch (T5's relative bias).

``megatrain::attention_bias_grad(q, k, v, out, grad_out, bias, keep, scale)`` -> float32 [heads, s_q, s_k]:
the sum over the batch of the score gradient ``P * (dO v^T - rowsum(dO * O))``, with
``P = softmax(q k^T * scale + bias, keys hidden where keep is False)``. It is what
:class:`~megatrain.models.common.bias_gradient.BiasGradient` computes in PyTorch, without any tensor of
size batch x heads x s_q x s_k: one kernel computes each row's log-sum-exp over the keys (and
``rowsum(dO * O)``), unless the caller has the forward's (SDPA's memory-efficient kernel keeps it: 0.27 ms
of the op's 0.9 a T5-base layer on an H100); a second gives each program one [BLOCK_M, BLOCK_N] tile
(``TILE``) of one head's bias gradient and loops over the batch inside, recomputing the tile's scores
and ``dO v^T`` with two small matmuls per sample and summing in registers, so the tile is written once
(no atomics) and the sample's q, k, v and dO tiles are read from cache by the programs of the same
head. (``SPLIT_BATCH`` > 1 shares each tile's batch among that many programs, which then add their sums
atomically.)

Registered as a custom operator so ``torch.compile`` treats it as one opaque call. It runs on CUDA, and
on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, how the tests check it).
"""

from __future__ import annotations

import functools
import os
import re
from typing import Optional

import torch

from megatrain.triton_support import kernel_available

__all__ = ["kernel_available", "attention_bias_grad"]

# (BLOCK_M, BLOCK_N, num_warps) of the gradient kernel (64 x 128 with 8 warps: the fastest of the tiles tried
# on an H100, 0.311 against 0.406 ms for 64 x 64 at a T5-base encoder layer, 2026-12-07); the log-sum-exp
# kernel's in LSE_TILE (or the environment; 64 x 64 with 4 warps stayed the fastest of eight). Module
# attributes read at each call (benchmarks/t5_attention.py and bias_gradient_kernel.py try others).
TILE = (64, 128, 8)
LSE_TILE_ENV = "MEGATRAIN_BIAS_GRAD_LSE_TILE"


def lse_tile_from_env(default: tuple[int, int, int] = (64, 64, 4)) -> tuple[int, int, int]:
    """``MEGATRAIN_BIAS_GRAD_LSE_TILE=BMxBNwW`` (e.g. ``128x64w8``): the log-sum-exp kernel's tile and warps, a
    speed setting (the same numbers); unset: ``default``. Powers of two from 16 (rows, keys) and 1-16 warps."""
    text = os.environ.get(LSE_TILE_ENV, "").strip()
    if not text:
        return default
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)", text)
    bm, bn, warps = map(int, m.groups()) if m else (0, 0, 0)
    if not (_power_of_two(bm) and _power_of_two(bn) and _power_of_two(warps) and min(bm, bn) >= 16
            and warps <= 16):
        raise ValueError(f"{LSE_TILE_ENV} must be BMxBNwW with powers of two (rows and keys >= 16, warps 1-16), "
                         f"e.g. 128x64w8; got {text!r}")
    return bm, bn, warps


def _power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


LSE_TILE: Optional[tuple[int, int, int]] = None  # None: lse_tile_from_env() at each call
# Programs per gradient tile, each summing its share of the batch and adding it into the tile with one
# atomic add (1: one program loops over the whole batch and stores the tile). More programs in flight
# for the same work; a benchmark variant (``t5_attention.py --variants sdpa-bias-tap-...-sS``).
SPLIT_BATCH = 1
# Software-pipelining stages of the gradient kernel's batch loop and of the log-sum-exp kernel's loop over
# the keys (None: Triton's default).
STAGES: Optional[int] = None
LSE_STAGES: Optional[int] = None


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def lse_kernel(Q, K, BIAS, KEEP, LSE, O, DO, DELTA, scale, H, KV_GROUP, M, N, D, DV,
                   sqb, sqh, sqm, sqd, skb, skh, skn, skd, sbh, sbm, sbn, skeepb, skeepm, skeepn,
                   sob, soh, som, sod, sdb, sdh, sdm, sdd,
                   HAS_KEEP: tl.constexpr, KEEP_ROWS: tl.constexpr, IEEE: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        hk = h // KV_GROUP
        rows = pid_m * BM + tl.arange(0, BM)
        dims = tl.arange(0, BD)
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
                    mask=(rows[:, None] < M) & (dims[None, :] < D), other=0.0)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        for start in tl.range(0, N, BN):
            cols = start + tl.arange(0, BN)
            k = tl.load(K + b * skb + hk * skh + cols[:, None] * skn + dims[None, :] * skd,
                        mask=(cols[:, None] < N) & (dims[None, :] < D), other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            inside = (rows[:, None] < M) & (cols[None, :] < N)
            bias = tl.load(BIAS + h * sbh + rows[:, None] * sbm + cols[None, :] * sbn, mask=inside, other=0.0)
            s = s * scale + bias.to(tl.float32)
            visible = inside
            if HAS_KEEP:
                if KEEP_ROWS:
                    keep = tl.load(KEEP + b * skeepb + rows[:, None] * skeepm + cols[None, :] * skeepn, mask=inside,
                                   other=0)
                else:  # padding alone ([b, 1, 1, s_k]): one row of keys, broadcast over the tile's rows
                    keep = tl.load(KEEP + b * skeepb + cols * skeepn, mask=cols < N, other=0)[None, :]
                visible = visible & (keep != 0)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
            m_i = m_new
        # a row whose keys are all hidden: +inf, so that its probabilities come out 0
        lse = tl.where(m_i == float("-inf"), float("inf"), m_i + tl.log(l_i))
        tl.store(LSE + pid_bh * M + rows, lse, mask=rows < M)
        # delta = rowsum(dO * O), the softmax backward's row term, from the same rows
        vdims = tl.arange(0, BDV)
        inside_v = (rows[:, None] < M) & (vdims[None, :] < DV)
        o = tl.load(O + b * sob + h * soh + rows[:, None] * som + vdims[None, :] * sod, mask=inside_v, other=0.0)
        do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdm + vdims[None, :] * sdd, mask=inside_v, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + pid_bh * M + rows, delta, mask=rows < M)

    @triton.jit
    def grad_kernel(Q, K, V, DO, BIAS, KEEP, LSE, DELTA, OUT, scale, B, H, KV_GROUP, M, N, D, DV,
                    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
                    sbh, sbm, sbn, skeepb, skeepm, skeepn, slb, slh, sdeltab, sdeltah,
                    HAS_KEEP: tl.constexpr, KEEP_ROWS: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
        h = tl.program_id(0) // SPLIT
        share = tl.program_id(0) % SPLIT
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(2)
        hk = h // KV_GROUP
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        dims = tl.arange(0, BD)
        vdims = tl.arange(0, BDV)
        inside = (rows[:, None] < M) & (cols[None, :] < N)
        bias = tl.load(BIAS + h * sbh + rows[:, None] * sbm + cols[None, :] * sbn, mask=inside, other=0.0)
        bias = bias.to(tl.float32)
        acc = tl.zeros([BM, BN], tl.float32)
        for b in tl.range(share, B, SPLIT):
            q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
                        mask=(rows[:, None] < M) & (dims[None, :] < D), other=0.0)
            k = tl.load(K + b * skb + hk * skh + cols[:, None] * skn + dims[None, :] * skd,
                        mask=(cols[:, None] < N) & (dims[None, :] < D), other=0.0)
            do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdm + vdims[None, :] * sdd,
                         mask=(rows[:, None] < M) & (vdims[None, :] < DV), other=0.0)
            v = tl.load(V + b * svb + hk * svh + cols[:, None] * svn + vdims[None, :] * svd,
                        mask=(cols[:, None] < N) & (vdims[None, :] < DV), other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
                dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
                dp = tl.dot(do, tl.trans(v))
            s = s * scale + bias
            visible = inside
            if HAS_KEEP:
                if KEEP_ROWS:
                    keep = tl.load(KEEP + b * skeepb + rows[:, None] * skeepm + cols[None, :] * skeepn, mask=inside,
                                   other=0)
                else:  # padding alone ([b, 1, 1, s_k]): one row of keys, broadcast over the tile's rows
                    keep = tl.load(KEEP + b * skeepb + cols * skeepn, mask=cols < N, other=0)[None, :]
                visible = visible & (keep != 0)
            lse = tl.load(LSE + b * slb + h * slh + rows, mask=rows < M, other=float("inf"))
            delta = tl.load(DELTA + b * sdeltab + h * sdeltah + rows, mask=rows < M, other=0.0)
            p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
            acc += p * (dp - delta[:, None])
        if SPLIT == 1:
            tl.store(OUT + h * M * N + rows[:, None] * N + cols[None, :], acc, mask=inside)
        else:
            tl.atomic_add(OUT + h * M * N + rows[:, None] * N + cols[None, :], acc, mask=inside)

    return triton, lse_kernel, grad_kernel


def _strides(t: torch.Tensor | None, n: int) -> list[int]:
    """``t``'s strides, 0 along size-1 (broadcast) dimensions; zeros for None."""
    if t is None:
        return [0] * n
    return [0 if size == 1 else stride for size, stride in zip(t.shape, t.stride())]


# Optional[...] rather than `X | None`: older torch's schema inference reads only typing's forms
@torch.library.custom_op("megatrain::attention_bias_grad", mutates_args=())
def attention_bias_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        grad_out: torch.Tensor, bias: torch.Tensor, keep: Optional[torch.Tensor],
                        scale: float, lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The batch-summed score gradient [heads, s_q, s_k] (float32) of SDPA(q, k, v) with the additive
    ``bias`` [1, heads, s_q, s_k] and ``keep`` (None or bool [b or 1, 1, s_q or 1, s_k]), given its
    output ``out`` and output gradient ``grad_out``; q [b, heads, s_q, d], k [b, heads_kv, s_k, d],
    v [b, heads_kv, s_k, dv]. ``lse``: the forward's log-sum-exp of each score row, float32 [b, heads,
    >= s_q] (as SDPA's memory-efficient kernel keeps it), in place of the kernel that computes it."""
    triton, lse_kernel, grad_kernel = _kernels()
    B, H, M, D = q.shape
    Hk, N, DV = k.shape[1], k.shape[2], v.shape[3]
    assert bias.dim() == 4 and bias.shape[0] == 1 and bias.shape[1] == H, "a bias shared by the batch"
    # one contiguous copy (12.6 MB at T5-base): T5's bias is a permuted view whose key stride is the head
    # count, which would make every tile load gather one float per 32-byte sector
    bias = bias.expand(1, H, M, N).contiguous()
    keep_u8 = None
    if keep is not None:
        assert keep.shape[1] == 1, "one keep mask for all heads"
        keep_u8 = keep.to(torch.uint8)
    ieee = q.dtype == torch.float32
    bd, bdv = triton.next_power_of_2(max(D, 16)), triton.next_power_of_2(max(DV, 16))
    sb, skeep = _strides(bias, 4), _strides(keep_u8, 4)
    keep_arg = keep_u8 if keep_u8 is not None else q  # unused without HAS_KEEP
    keep_rows = keep_u8 is not None and keep_u8.shape[2] > 1  # else one row of keys for every query
    if lse is None:
        lse = torch.empty(B, H, M, dtype=torch.float32, device=q.device)
        delta = torch.empty(B, H, M, dtype=torch.float32, device=q.device)
        lbm, lbn, lwarps = LSE_TILE or lse_tile_from_env()
        lse_kernel[(B * H, triton.cdiv(M, lbm))](
            q, k, bias, keep_arg, lse, out, grad_out, delta, scale, H, H // Hk, M, N, D, DV, *q.stride(),
            *k.stride(), sb[1], sb[2], sb[3], skeep[0], skeep[2], skeep[3], *out.stride(), *grad_out.stride(),
            HAS_KEEP=keep_u8 is not None, KEEP_ROWS=keep_rows, IEEE=ieee, BM=lbm, BN=lbn, BD=bd, BDV=bdv,
            num_warps=lwarps, **({} if LSE_STAGES is None else {"num_stages": int(LSE_STAGES)}))
    else:
        assert lse.dtype == torch.float32 and lse.shape[:2] == (B, H) and lse.shape[2] >= M
        lse = lse if lse.stride(2) == 1 else lse.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)
    bm, bn, warps = TILE
    split = max(1, min(int(SPLIT_BATCH), B))
    grad = (torch.zeros if split > 1 else torch.empty)(H, M, N, dtype=torch.float32, device=q.device)
    grad_kernel[(H * split, triton.cdiv(M, bm), triton.cdiv(N, bn))](
        q, k, v, grad_out, bias, keep_arg, lse, delta, grad, scale, B, H, H // Hk, M, N, D, DV,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), sb[1], sb[2], sb[3], skeep[0], skeep[2], skeep[3],
        lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1), HAS_KEEP=keep_u8 is not None,
        KEEP_ROWS=keep_rows, IEEE=ieee, SPLIT=split, BM=bm, BN=bn, BD=bd, BDV=bdv, num_warps=warps,
        **({} if STAGES is None else {"num_stages": int(STAGES)}))
    return grad


@attention_bias_grad.register_fake
def _(q, k, v, out, grad_out, bias, keep, scale, lse=None):
    return q.new_empty((q.shape[1], q.shape[2], k.shape[2]), dtype=torch.float32)
