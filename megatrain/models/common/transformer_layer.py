"""The pre-norm transformer layer every family stacks: self-attention, optionally cross-attention over
another sequence (an encoder-decoder's decoder layer), and MLP, each behind a norm and added to the
residual stream.

Module paths inside a layer are a contract with the parallel code (tensor-parallel plans,
recomputation, context parallelism): ``input_layernorm``, ``self_attention.{linear_qkv,
core_attention, linear_proj}`` (with ``--qk-layernorm`` also ``q_layernorm``, ``k_layernorm``), with cross-attention ``pre_cross_attn_layernorm`` and
``cross_attention.{linear_q, linear_kv, core_attention, linear_proj}`` (Megatron's names),
``pre_mlp_layernorm``, ``mlp.{linear_fc1, linear_fc2}``, ``dropout``. With multi-latent attention
``self_attention`` is a :class:`~megatrain.models.common.mla.MLASelfAttention` (``linear_q_proj`` or
``linear_q_down_proj``/``q_layernorm``/``linear_q_up_proj``, ``linear_kv_down_proj``, ``kv_layernorm``,
``linear_kv_up_proj``, ``core_attention``, ``linear_proj``). In a mixture-of-experts layer
(``config.is_moe_layer(layer_number)``, ``layer_number`` 0-based) ``mlp`` is a
:class:`~megatrain.models.common.moe.layer.MoELayer` (``mlp.router``, ``mlp.experts.{linear_fc1,
linear_fc2}``, ``mlp.shared_experts.{linear_fc1, linear_fc2, gate_weight}``).
"""

from __future__ import annotations

import torch
from torch import nn

from megatrain.models.common.attention import CrossAttention, KVCache, SelfAttention
from megatrain.models.common.config import TransformerConfig
from megatrain.models.common.mlp import MLP
from megatrain.models.common.norms import build_norm

__all__ = ["TransformerLayer"]


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), with ``cross_attention`` then
    x + drop(cross_attn(norm(x), context)), then x + drop(mlp(norm(x))).

    ``causal``: the self-attention's rule without a mask (default: the config's ``causal_attention``).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, *, causal: bool | None = None,
                 cross_attention: bool = False) -> None:
        super().__init__()
        self.input_layernorm = build_norm(config)
        if getattr(config, "multi_latent_attention", False):
            from megatrain.models.common.mla import MLASelfAttention  # only MLA models import it

            self.self_attention: nn.Module = MLASelfAttention(config, layer_number, causal=causal)
        else:
            self.self_attention = SelfAttention(config, layer_number, causal=causal)
        self.pre_cross_attn_layernorm: nn.Module | None = build_norm(config) if cross_attention else None
        self.cross_attention: CrossAttention | None = (CrossAttention(config, layer_number) if cross_attention
                                                       else None)
        self.pre_mlp_layernorm = build_norm(config)
        if config.is_moe_layer(layer_number):
            from megatrain.models.common.moe.layer import MoELayer  # only MoE models import it

            self.mlp: nn.Module = MoELayer(config, layer_number)
        else:
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
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``context`` [b, s_ctx, h] (with cross-attention: the encoder output) and ``context_mask``
        (bool, True = may attend; see :class:`CrossAttention`). ``kv_cache``: incremental decoding
        (the self-attention's keys and values so far, and the cross-attention's)."""
        attn_out = self.self_attention(self.input_layernorm(hidden), position_ids, attention_mask, kv_cache,
                                       rotary=rotary)
        hidden = hidden + self.dropout(attn_out)
        if self.cross_attention is not None:
            assert self.pre_cross_attn_layernorm is not None
            if context is None:
                raise ValueError("a layer with cross-attention needs the context (the encoder output)")
            normed = self.pre_cross_attn_layernorm(hidden)
            cross_out = (self.cross_attention(normed, context, context_mask) if kv_cache is None
                         else self.cross_attention(normed, context, context_mask, kv_cache=kv_cache))
            hidden = hidden + self.dropout(cross_out)
        mlp_out = self.mlp(self.pre_mlp_layernorm(hidden))
        return hidden + self.dropout(mlp_out)
