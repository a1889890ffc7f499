"""Multi-latent attention (DeepSeek-V2/V3; Megatron's ``MLASelfAttention``, ``--multi-latent-attention``).

Per token, with h hidden, n heads, P = --qk-head-dim (dims without positions), R =
--qk-pos-emb-head-dim (rotated dims), V = --v-head-dim, C = --kv-lora-rank, Q = --q-lora-rank:

    queries  q = linear_q_proj(x)                                  [n, P + R]   (no --q-lora-rank)
             q = linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))           (rank Q bottleneck)
    latent   c, k_r = split(linear_kv_down_proj(x), [C, R])        one C-dim latent, one R-dim key part
    keys     k_p, v = split(linear_kv_up_proj(kv_layernorm(c)), [P, V] per head)
    attention over  q = [q_p, rope(q_r)],  k = [k_p, rope(k_r)] (k_r shared by every head),  v

then ``linear_proj`` [h, n V]. The norms on the two latents exist with ``--qk-layernorm`` (Megatron
builds them only then; DeepSeek's checkpoints have them). RoPE here is Megatron's MLA form: the R dims
are first de-interleaved ((x0, x2, ...), (x1, x3, ...)) and then rotated as two halves, with YaRN
frequencies (``--rope-type yarn``, the default) or plain ones; the softmax scale is
mscale(--rotary-scaling-factor, --mscale-all-dim)^2 / sqrt(P + R).

Module paths are Megatron's (``self_attention.linear_q_down_proj``, ...). Under tensor parallelism the
up projections and ``linear_q_proj`` are column parallel (whole heads per rank), ``linear_proj`` row
parallel, the down projections and latent norms replicated; ``k_pos_emb_region`` (parameter-free) is
where the shared rotated key enters the rank's heads: its gradient sums over the ranks
(:class:`~megatrain.models.common.tp_plan.CopyToTensorParallelRegion`).

The KV cache holds the up-projected keys [b, n, s, P + R] and values [b, n, s, V] (no latent caching).
"""

from __future__ import annotations

import torch
from torch import nn

from megatrain.models.common.attention import AttendingKVCache, CoreAttention, KVCache
from megatrain.models.common.config import TransformerConfig
from megatrain.models.common.flex_attention import FlexAttentionMask
from megatrain.models.common.mla_config import mla_softmax_scale, yarn_mscale
from megatrain.models.common.norms import build_norm
from megatrain.models.common.rope import apply_rotary, mla_rotary_tables

__all__ = ["MLASelfAttention", "deinterleave"]


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...] over the last dim (Megatron's MLA RoPE input)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLASelfAttention(nn.Module):
    """Multi-latent self-attention: ``forward`` takes what :class:`SelfAttention`'s does."""

    def __init__(self, config: TransformerConfig, layer_number: int, causal: bool | None = None) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.qk_head_dim, self.pos_dim, self.v_head_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        n, h = config.num_attention_heads, config.hidden_size
        q_dim = self.qk_head_dim + self.pos_dim
        self.q_lora_rank = config.q_lora_rank
        if config.q_lora_rank is None:
            self.linear_q_proj = nn.Linear(h, n * q_dim, bias=False)
        else:
            self.linear_q_down_proj = nn.Linear(h, config.q_lora_rank, bias=False)
            self.q_layernorm: nn.Module | None = (build_norm(config, config.q_lora_rank) if config.qk_layernorm
                                                  else None)
            self.linear_q_up_proj = nn.Linear(config.q_lora_rank, n * q_dim, bias=False)
        self.linear_kv_down_proj = nn.Linear(h, config.kv_lora_rank + self.pos_dim, bias=False)
        self.kv_layernorm: nn.Module | None = build_norm(config, config.kv_lora_rank) if config.qk_layernorm else None
        self.linear_kv_up_proj = nn.Linear(config.kv_lora_rank, n * (self.qk_head_dim + self.v_head_dim), bias=False)
        self.k_pos_emb_region = nn.Identity()
        m = yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
        self.core_attention = CoreAttention(config, causal=causal, window=config.window_size,
                                            softmax_scale=None if m == 1.0 else mla_softmax_scale(config))
        self.linear_proj = nn.Linear(n * self.v_head_dim, h, bias=config.add_bias_linear)

    def queries(self, x_bsh: torch.Tensor) -> torch.Tensor:
        """[b, s, h] -> [b, heads, s, P + R] (before RoPE)."""
        b, s, _ = x_bsh.shape
        if self.q_lora_rank is None:
            q = self.linear_q_proj(x_bsh)
        else:
            q = self.linear_q_down_proj(x_bsh)
            if self.q_layernorm is not None:
                q = self.q_layernorm(q)
            q = self.linear_q_up_proj(q)
        return q.view(b, s, -1, self.qk_head_dim + self.pos_dim).transpose(1, 2)

    def forward(
        self,
        x_bsh: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | FlexAttentionMask | None = None,
        kv_cache: KVCache | AttendingKVCache | None = None,
        *,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h]; the arguments as :meth:`SelfAttention.forward` (``rotary``: this
        model's MLA tables, :func:`~megatrain.models.common.rope.mla_rotary_tables`)."""
        b, s, _ = x_bsh.shape
        past = kv_cache.layer_length(self.layer_number) if kv_cache is not None else 0
        q = self.queries(x_bsh)
        heads = q.shape[1]
        latent, k_rot = self.linear_kv_down_proj(x_bsh).split([self.kv_lora_rank, self.pos_dim], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        kv = self.linear_kv_up_proj(latent).view(b, s, -1, self.qk_head_dim + self.v_head_dim).transpose(1, 2)
        k_plain, v = kv.split([self.qk_head_dim, self.v_head_dim], dim=-1)
        q_plain, q_rot = q.split([self.qk_head_dim, self.pos_dim], dim=-1)
        k_rot = self.k_pos_emb_region(k_rot).unsqueeze(1)  # [b, 1, s, R]: one for every head

        if rotary is None:
            if position_ids is None:
                position_ids = torch.arange(past, past + s, device=x_bsh.device).unsqueeze(0)
            rotary = mla_rotary_tables(self.config, position_ids)
        cos, sin = rotary
        q_rot = apply_rotary(deinterleave(q_rot), cos, sin)
        k_rot = apply_rotary(deinterleave(k_rot), cos, sin)
        q = torch.cat((q_plain, q_rot), dim=-1)
        k = torch.cat((k_plain, k_rot.expand(-1, heads, -1, -1).to(k_plain.dtype)), dim=-1)
        v = v.contiguous()

        if isinstance(kv_cache, AttendingKVCache):
            out = kv_cache.attend(self.layer_number, q, k, v, self.core_attention)
        else:
            if kv_cache is not None:
                k, v = kv_cache.update(self.layer_number, k, v)
            out = self.core_attention(q, k, v, attention_mask, past)  # [b, heads, s, V]
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, -1))
