"""The pre-norm transformer layer every family stacks: self-attention and MLP, each behind a norm
and added to the residual stream.

Module paths inside a layer are a contract with the parallel code (tensor-parallel plans,
recomputation, context parallelism): ``input_layernorm``, ``self_attention.{linear_qkv,
core_attention, linear_proj}``, ``pre_mlp_layernorm``, ``mlp.{linear_fc1, linear_fc2}``, ``dropout``.
"""

from __future__ import annotations

import torch
from torch import nn

from megatrain.models.common.attention import KVCache, SelfAttention
from megatrain.models.common.config import TransformerConfig
from megatrain.models.common.mlp import MLP
from megatrain.models.common.norms import build_norm

__all__ = ["TransformerLayer"]


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, config: TransformerConfig, layer_number: int) -> None:
        super().__init__()
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config, layer_number)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        *,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        attn_out = self.self_attention(self.input_layernorm(hidden), position_ids, attention_mask, kv_cache,
                                       rotary=rotary)
        hidden = hidden + self.dropout(attn_out)
        mlp_out = self.mlp(self.pre_mlp_layernorm(hidden))
        return hidden + self.dropout(mlp_out)
