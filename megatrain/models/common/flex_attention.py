"""Attention with a relative position bias and padding through FlexAttention (``torch.nn.attention.flex_attention``).

SDPA takes an attention bias only as an explicit float mask: T5's relative position bias with the
padded keys folded in is a [b, heads, s, s] tensor, with a gradient of that size for every layer, and
an explicit float mask keeps SDPA off its flash kernel. FlexAttention computes the same attention in
one fused kernel from two small descriptions instead, and nothing of size s x s is materialised:

* the bias as a ``score_mod``: ``score + bias[h, k - q]``, read from a [heads, distances] table of
  the bias of every key-minus-query distance (the relative position bucket of each of the about
  ``s_q + s_k`` distances, looked up once per forward in the [buckets, heads] embedding; its
  gradient flows back through that lookup into the embedding);
* the hidden keys (padding; later keys too for a causal decoder) as a ``BlockMask``, built from the
  [b, s_k] padding vector at the granularity of flex's 128 x 128 tiles (O(b s) work, no s x s mask):
  tiles with no visible key are skipped, tiles with every key visible run without a mask, the rest
  read the padding vector through a ``mask_mod``.

A model builds one :class:`FlexAttentionMask` per attention kind and forward (T5: encoder self-,
decoder self- and cross-attention) and hands it to every layer in place of an SDPA mask;
``CoreAttention`` sees the type and calls :func:`flex_attention_forward`.

flex_attention is fast only compiled: outside a compiled region :func:`flex_attention_forward`
calls one ``torch.compile(flex_attention)`` made on first use (module level, shared by every layer);
inside one (per-layer ``--use-torch-compile`` or the whole-model compile) it calls flex_attention
itself, which dynamo compiles as part of the region. FlexAttention has no backward on CPU (and no
attention dropout), so models keep SDPA there; the forward runs anywhere (tests compare the two).
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - an older torch: SDPA only
    BlockMask = flex_attention = None  # type: ignore[assignment,misc]

__all__ = ["BLOCK_SIZE", "FlexAttentionMask", "flex_attention_available", "padding_block_mask",
           "flex_attention_forward", "flex_mask"]

BLOCK_SIZE = 128  # flex_attention's default sparse tile (queries x keys)
# BlockMask.from_kv_blocks takes the true sequence lengths (else it assumes whole tiles).
_TAKES_SEQ_LENGTHS = BlockMask is not None and "seq_lengths" in inspect.signature(BlockMask.from_kv_blocks).parameters


def flex_attention_available() -> bool:
    """Whether this torch has ``torch.nn.attention.flex_attention`` (torch >= 2.5)."""
    return flex_attention is not None


@dataclass
class FlexAttentionMask:
    """What attention hands to flex_attention in place of an SDPA mask.

    ``block_mask``: the hidden keys (None: every key visible to every query). ``position_bias``: None,
    or the bias [heads, L] or [b, heads, L] (float32) added to the score of query i and key j, at
    column ``j - i + bias_offset``; the same for every layer. Its gradient is scattered by the
    backward kernel with one atomic add per score into the bias's own gradient: a copy per batch row
    ([b, heads, L], summed over b by autograd) spreads those adds over b times more addresses.
    """

    block_mask: Any = None  # torch.nn.attention.flex_attention.BlockMask | None
    position_bias: torch.Tensor | None = None
    bias_offset: int = 0


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """0/1 tiles [B, H, rows, cols] -> (tiles per row [B, H, rows], their column ids first, ascending
    [B, H, rows, cols]): BlockMask's layout (flex_attention's ``_dense_to_ordered``)."""
    dense = dense.to(torch.int32)
    count = dense.sum(dim=-1).to(torch.int32)
    order = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return count.contiguous(), order.contiguous()


def padding_block_mask(key_keep: torch.Tensor | None, q_len: int, k_len: int, *, causal: bool,
                       device: torch.device | None = None) -> Any:
    """The BlockMask for queries [0, q_len) over keys [0, k_len): key j visible where ``key_keep``
    [b, k_len] (bool, True = a real token) says so, and, when ``causal``, only to queries i >= j.
    None when nothing is hidden (no padding vector and not causal).

    The tiles are what ``create_block_mask`` gives for that mask_mod, computed from the padding
    vector alone: a tile with no visible key is left out, one whose every (query, key) pair is
    visible is "full" (no mask_mod), the rest are partial (positions past the sequence end count
    as hidden, so a tile that crosses it is never full).
    """
    if key_keep is None and not causal:
        return None
    if causal and q_len != k_len:
        raise ValueError(f"a causal block mask needs as many queries as keys, got {q_len} and {k_len}")
    device = key_keep.device if key_keep is not None else device
    b = key_keep.shape[0] if key_keep is not None else 1
    n_q, n_k = _round_up(q_len, BLOCK_SIZE) // BLOCK_SIZE, _round_up(k_len, BLOCK_SIZE) // BLOCK_SIZE
    if key_keep is None:
        keep = torch.ones(b, k_len, dtype=torch.bool, device=device)
    else:
        if key_keep.shape[1] != k_len:
            raise ValueError(f"key_keep covers {key_keep.shape[1]} keys, expected {k_len}")
        keep = key_keep.bool()
    # Padded to whole tiles with hidden keys: mask_mod may read any key index of a tile.
    keep = torch.nn.functional.pad(keep, (0, n_k * BLOCK_SIZE - k_len), value=False)
    visible = keep.view(b, n_k, BLOCK_SIZE).sum(dim=-1)  # [b, n_k] visible keys per key tile
    whole_q_tile = torch.arange(n_q, device=device) < q_len // BLOCK_SIZE  # only the last may be short
    any_key = (visible > 0)[:, None, :].expand(b, n_q, n_k)  # [b, n_q, n_k]
    every_pair = (visible == BLOCK_SIZE)[:, None, :] & whole_q_tile[None, :, None]
    if causal:
        qi = torch.arange(n_q, device=device)[:, None]
        kj = torch.arange(n_k, device=device)[None, :]
        # Tiles right of the diagonal are hidden; a diagonal tile is never full (its later keys are
        # hidden from its earlier queries); left of it, every query sees every visible key.
        any_key = any_key & (kj <= qi)
        every_pair = every_pair & (kj < qi)
    full = every_pair.expand(b, n_q, n_k)
    partial = any_key & ~full
    kv_num, kv_idx = _ordered(partial[:, None])
    full_num, full_idx = _ordered(full[:, None])

    # (A block mask of one batch row serves every row: its mask_mod must not read per-row data.)
    def padding_mod(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return keep[batch, kv_idx]

    def causal_padding_mod(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor,
                           kv_idx: torch.Tensor) -> torch.Tensor:
        return keep[batch, kv_idx] & (q_idx >= kv_idx)

    def causal_mod(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return q_idx >= kv_idx

    mask_mod = padding_mod if not causal else causal_padding_mod if key_keep is not None else causal_mod
    kwargs: dict[str, Any] = {"BLOCK_SIZE": BLOCK_SIZE, "mask_mod": mask_mod}
    if _TAKES_SEQ_LENGTHS:
        kwargs["seq_lengths"] = (q_len, k_len)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, **kwargs)


def flex_mask(key_keep: torch.Tensor | None, q_len: int, k_len: int, *, causal: bool, device: torch.device,
              position_bias: tuple[torch.Tensor, int] | None = None) -> FlexAttentionMask:
    """A :class:`FlexAttentionMask`: :func:`padding_block_mask` and the (bias [heads, L], offset) pair."""
    bias, offset = position_bias if position_bias is not None else (None, 0)
    return FlexAttentionMask(padding_block_mask(key_keep, q_len, k_len, causal=causal, device=device), bias, offset)


_COMPILED: Callable[..., torch.Tensor] | None = None

KERNEL_OPTIONS_ENV = "MEGATRAIN_FLEX_KERNEL_OPTIONS"

# Tiles for the CUDA kernels (forward BLOCK_M x BLOCK_N, backward M1/N1 and M2/N2) no larger than
# what fits the shared memory of one Hopper SM when the whole model is compiled around the call: the
# defaults (128 x 64, three stages) asked for 304 KiB of the H200's 227 KiB in T5-base's compiled
# training step.
CUDA_KERNEL_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2,
                       "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}


def cuda_kernel_options() -> dict[str, Any]:
    """The CUDA kernels' options: :data:`CUDA_KERNEL_OPTIONS`, or a JSON object in the environment variable
    ``MEGATRAIN_FLEX_KERNEL_OPTIONS`` (flex_attention's ``kernel_options``: ``BLOCK_M``, ``num_stages``, ...;
    ``fwd_``/``bwd_`` prefixed for one kernel only; ``{}`` for inductor's own choice) for a GPU the defaults
    do not suit."""
    text = os.environ.get(KERNEL_OPTIONS_ENV)
    if text is None:
        return dict(CUDA_KERNEL_OPTIONS)
    try:
        options = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{KERNEL_OPTIONS_ENV}: not JSON ({e}): {text!r}") from None
    if not isinstance(options, dict) or not all(isinstance(k, str) and isinstance(v, (int, float, bool))
                                                for k, v in options.items()):
        raise ValueError(f"{KERNEL_OPTIONS_ENV}: expected a JSON object of names to numbers, got {text!r}")
    return options


def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """``torch.compile(flex_attention)``, made once (its compiled kernels are shared by every layer)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(flex_attention)
    return _COMPILED


def _is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def flex_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlexAttentionMask, *,
                           enable_gqa: bool = False, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v over the keys ``mask`` leaves visible (scale default 1/sqrt(d)):
    q [b, heads, s_q, d], k and v [b, heads or groups, s_k, d] -> [b, heads, s_q, d] (no dropout)."""
    score_mod = None
    bias = mask.position_bias
    if bias is not None:
        offset = mask.bias_offset

        # The captured tensor itself, indexed once (no view of it made here: flex's backward
        # scatters the score gradients into the captured tensor's own gradient).
        if bias.dim() == 3:
            def score_mod(score: torch.Tensor, batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor,
                          kv_idx: torch.Tensor) -> torch.Tensor:
                return score + bias[batch, head, kv_idx - q_idx + offset]
        else:
            def score_mod(score: torch.Tensor, batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor,
                          kv_idx: torch.Tensor) -> torch.Tensor:
                return score + bias[head, kv_idx - q_idx + offset]

    kwargs: dict[str, Any] = {"score_mod": score_mod, "block_mask": mask.block_mask}
    if q.is_cuda:
        kwargs["kernel_options"] = cuda_kernel_options()
    if enable_gqa:
        kwargs["enable_gqa"] = True
    if scale is not None:
        kwargs["scale"] = scale
    if _is_compiling() or q.device.type == "cpu":
        # Compiled with the region around it; on CPU (forward only) the eager reference is enough.
        return flex_attention(q, k, v, **kwargs)
    return _compiled_flex_attention()(q, k, v, **kwargs)
