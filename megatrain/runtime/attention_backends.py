"""Which SDPA kernel attention gets: a start-up probe that warns when only the math fallback runs.

``torch.nn.functional.scaled_dot_product_attention`` silently falls back to its math kernel (slow,
with an s x s score matrix in memory) when no fused kernel accepts the inputs: an unsupported
head dim, float32 with flash, an explicit mask with flash, an old GPU. :func:`probe_backends`
runs one tiny forward and backward per fused backend (flash, memory-efficient, cuDNN) with the
model's head dim, heads per group, dtype, dropout and mask kind, each restricted through
``torch.nn.attention.sdpa_kernel``; :func:`attention_warning` turns the results into a warning
(or None); :func:`warn_if_attention_falls_back` does both and prints it once on rank 0.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from megatrain.models.common.config import TransformerConfig


__all__ = ["AttentionCase", "static_hints", "probe_backends", "attention_warning", "warn_if_attention_falls_back"]

FAST_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


@dataclass(frozen=True)
class AttentionCase:
    """What the model's attention hands to SDPA (the parts that decide the kernel)."""

    head_dim: int
    heads_per_group: int
    dtype: torch.dtype
    dropout: float = 0.0
    explicit_mask: bool = False  # --reset-attention-mask: a bool [b, 1, s, s] mask instead of is_causal

    @classmethod
    def from_config(cls, config: TransformerConfig, dtype: torch.dtype, explicit_mask: bool = False) -> "AttentionCase":
        return cls(config.head_dim, config.heads_per_group, dtype, config.attention_dropout, explicit_mask)


def static_hints(case: AttentionCase) -> list[str]:
    """Known reasons the fastest kernels refuse ``case`` (a hint; the probe is the judge)."""
    hints = []
    if case.dtype not in (torch.float16, torch.bfloat16):
        hints.append(f"{str(case.dtype).replace('torch.', '')} inputs: flash and cuDNN attention need "
                     f"fp16/bf16 (use --bf16)")
    if case.head_dim > 256:
        hints.append(f"head dim {case.head_dim} > 256, the largest fused attention kernels support "
                     f"(--kv-channels)")
    if case.head_dim % 8:
        hints.append(f"head dim {case.head_dim} is not a multiple of 8 (--kv-channels)")
    if case.explicit_mask:
        hints.append("an explicit attention mask (--reset-attention-mask): flash attention takes only causal "
                     "masks")
    return hints


def probe_backends(case: AttentionCase, device: torch.device, seq_length: int = 128
                   ) -> dict[str, str | None]:
    """For each fused backend: None when a forward and backward of ``case`` ran on it, else why not."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    groups = 2
    heads = groups * case.heads_per_group
    shape_q = (1, heads, seq_length, case.head_dim)
    shape_kv = (1, groups, seq_length, case.head_dim)
    results: dict[str, str | None] = {}
    for name in FAST_BACKENDS:
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            results[name] = "not in this torch version"
            continue
        q = torch.randn(shape_q, device=device, dtype=case.dtype, requires_grad=True)
        k = torch.randn(shape_kv, device=device, dtype=case.dtype, requires_grad=True)
        v = torch.randn(shape_kv, device=device, dtype=case.dtype, requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([backend]):
                    # The same call pattern as megatrain.models.common.attention.CoreAttention.
                    if case.explicit_mask:
                        mask = torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).tril()
                        kk = k.repeat_interleave(case.heads_per_group, dim=1)
                        vv = v.repeat_interleave(case.heads_per_group, dim=1)
                        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[None, None],
                                                             dropout_p=case.dropout)
                    elif case.heads_per_group > 1:
                        out = F.scaled_dot_product_attention(q, k, v, dropout_p=case.dropout, is_causal=True,
                                                             enable_gqa=True)
                    else:
                        kk, vv = k.expand(1, heads, -1, -1), v.expand(1, heads, -1, -1)
                        out = F.scaled_dot_product_attention(q, kk, vv, dropout_p=case.dropout, is_causal=True)
                    out.float().sum().backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                results[name] = None
            except Exception as e:  # noqa: BLE001 -- a refusing kernel must never stop start-up
                reasons = [str(w.message).strip() for w in caught]
                results[name] = "; ".join(reasons) or str(e).strip().splitlines()[0]
    return results


def attention_warning(results: dict[str, str | None], hints: list[str]) -> str | None:
    """The warning to print for probe ``results`` (None when some fused kernel ran)."""
    if any(reason is None for name, reason in results.items() if name in FAST_BACKENDS):
        return None
    lines = ["WARNING: no fused SDPA attention kernel accepts this model's attention; it will run the math "
             "fallback (much slower, s x s scores in memory)."]
    if hints:
        lines.append("  likely cause: " + "; ".join(hints))
    for name in FAST_BACKENDS:
        if name in results:
            lines.append(f"  {name.lower()}: {results[name]}")
    return "\n".join(lines)


def warn_if_attention_falls_back(config: TransformerConfig, dtype: torch.dtype, device: torch.device, *,
                                 explicit_mask: bool = False) -> str | None:
    """Probe on ``device`` (CUDA); print the warning on rank 0 and return it (None when all is well)."""
    if device.type != "cuda":
        return None
    case = AttentionCase.from_config(config, dtype, explicit_mask)
    with torch.random.fork_rng(devices=[device]):  # the probe's random inputs leave training's RNG alone
        results = probe_backends(case, device)
    message = attention_warning(results, static_hints(case))
    dist = torch.distributed
    if message and (not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0):
        print(message, flush=True)
    return message
