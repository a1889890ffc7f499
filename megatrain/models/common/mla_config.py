"""Checks of the multi-latent attention settings of a :class:`TransformerConfig` (Megatron's
``MLATransformerConfig`` and ``arguments.py`` rules), and the numbers its attention derives from them."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_mla_config", "mla_softmax_scale", "yarn_mscale"]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(cfg: Any) -> float:
    """Megatron's MLA softmax scale: mscale(factor, mscale_all_dim)^2 / sqrt(qk_head_dim + pos dims)."""
    m = yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim)
    return m * m / math.sqrt(cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)


def check_mla_config(cfg: Any) -> None:
    """Raise ValueError (naming the flag) for settings multi-latent attention cannot take."""
    if not type(cfg).supports_mla:
        raise ValueError(f"--multi-latent-attention: the {type(cfg).__name__.removesuffix('Config')} family has no "
                         f"multi-latent attention (GPT-style decoders have)")
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if cfg.q_lora_rank is not None and (isinstance(cfg.q_lora_rank, bool) or not isinstance(cfg.q_lora_rank, int)
                                        or cfg.q_lora_rank <= 0):
        raise ValueError(f"--q-lora-rank must be a positive integer (or unset), got {cfg.q_lora_rank!r}")
    if cfg.qk_pos_emb_head_dim % 2:
        raise ValueError(f"--qk-pos-emb-head-dim must be even (RoPE rotates pairs), got {cfg.qk_pos_emb_head_dim}")
    if cfg.num_query_groups != cfg.num_attention_heads:
        raise ValueError("--group-query-attention and --multi-latent-attention exclude each other (as in Megatron-LM)")
    if cfg.rope_type is None:
        cfg.rope_type = "yarn"  # Megatron's MLA default
    if cfg.rope_type not in ("rope", "yarn"):
        raise ValueError(f"--rope-type must be rope or yarn, got {cfg.rope_type!r}")
    if cfg.rotary_percent != 1.0:
        raise ValueError(f"--rotary-percent {cfg.rotary_percent}: multi-latent attention rotates all "
                         f"--qk-pos-emb-head-dim dims (use 1.0)")
    if cfg.rotary_interleaved:
        raise ValueError("--rotary-interleaved does not apply to multi-latent attention (its RoPE has its own "
                         "pairing, as Megatron's)")
    if cfg.use_rope_scaling:
        raise ValueError("--use-rope-scaling (Llama 3.x) does not apply to multi-latent attention: use --rope-type "
                         "yarn with --rotary-scaling-factor")
    if cfg.add_qkv_bias:
        raise ValueError("--add-qkv-bias: multi-latent attention's projections have no biases (as Megatron's)")
    if not cfg.rotary_scaling_factor > 0:
        raise ValueError(f"--rotary-scaling-factor must be positive, got {cfg.rotary_scaling_factor}")
    for name in ("yarn_original_max_position_embeddings",):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not cfg.yarn_beta_fast > 0 or not cfg.yarn_beta_slow > 0:
        raise ValueError(f"YaRN's beta_fast ({cfg.yarn_beta_fast}) and beta_slow ({cfg.yarn_beta_slow}) must be "
                         f"positive")
