"""Self-attention (causal, or bidirectional for encoders) with grouped query heads, rotary positions
and an optional KV cache; cross-attention (an encoder-decoder's decoder over the encoder output).

Weight layout (Megatron's grouped QKV): ``linear_qkv.weight`` has ``(n + 2g) * d`` rows that,
viewed as ``[g, n/g + 2, d, h]``, hold for each query group its n/g query heads, then its key
head, then its value head. Splitting the rows evenly across tensor-parallel ranks therefore
gives each rank whole groups, so the forward code below only ever uses the rank-invariant sizes
``n/g`` (heads per group) and ``d`` (head dim) and reads the number of groups from the tensor.
Cross-attention (Megatron's ``CrossAttention``) has ``linear_q`` [n d, h] and ``linear_kv``
[2 n d, h], whose rows viewed as ``[n, 2, d]`` hold each head's key then its value: an even row
split again gives each rank whole heads.

Masks are bool (True = may attend) or floating point, added to the scores: an attention bias (T5's
relative positions) with the masked keys set to -inf in it. A
:class:`~megatrain.models.common.flex_attention.FlexAttentionMask` instead (the bias as a [heads,
distances] table, the hidden keys as a block mask) runs the attention through FlexAttention.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.models.common.config import TransformerConfig
from megatrain.models.common.bias_gradient import BiasedMask, attention_with_bias
from megatrain.models.common.flex_attention import FlexAttentionMask, flex_attention_forward
from megatrain.models.common.norms import build_norm
from megatrain.models.common.rope import RotaryEmbedding, apply_rotary, rope_scaling_of


class KVCache:
    """Keys and values of the tokens seen so far, per layer, for incremental decoding.

    Storage is allocated lazily on a layer's first update as ``[b, groups, max_length, d]``, with
    the batch size, number of key/value heads, dtype and device of the keys it receives. An
    encoder-decoder's decoder also keeps each layer's cross-attention keys and values here: computed
    from the encoder output on the first step, reused by every later one (:meth:`cross_attention`).
    """

    def __init__(self, max_length: int) -> None:
        if max_length <= 0:
            raise ValueError(f"KV cache max_length must be positive, got {max_length}")
        self.max_length = max_length
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._lengths: dict[int, int] = {}
        self._cross: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cross_attention(self, layer_number: int,
                        compute: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cross-attention keys and values [b, heads, s_ctx, d]: ``compute()`` on the first
        call, the stored pair after (the encoder output does not change while decoding)."""
        if layer_number not in self._cross:
            self._cross[layer_number] = compute()
        return self._cross[layer_number]

    @property
    def length(self) -> int:
        """Tokens already stored (read it before a forward: layers advance one by one during it)."""
        return max(self._lengths.values(), default=0)

    def layer_length(self, layer_number: int) -> int:
        return self._lengths.get(layer_number, 0)

    def update(
        self, layer_number: int, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one layer's new keys/values [b, g, s, d]; return all of them so far."""
        start = self.layer_length(layer_number)
        end = start + k_bgsd.shape[2]
        if end > self.max_length:
            raise ValueError(f"KV cache is full: {end} tokens do not fit in max_length={self.max_length}")
        if layer_number not in self._keys:  # values may be narrower than keys (multi-latent attention)
            b, g, _, d = k_bgsd.shape
            self._keys[layer_number] = k_bgsd.new_empty((b, g, self.max_length, d))
            self._values[layer_number] = v_bgsd.new_empty((b, g, self.max_length, v_bgsd.shape[-1]))
        keys, values = self._keys[layer_number], self._values[layer_number]
        assert keys.shape[0] == k_bgsd.shape[0], "batch size changed while using one KV cache"
        keys[:, :, start:end] = k_bgsd
        values[:, :, start:end] = v_bgsd
        self._lengths[layer_number] = end
        return keys[:, :, :end], values[:, :, :end]


class AttendingKVCache(ABC):
    """A KV cache that stores each layer's new keys/values and computes that layer's attention itself
    (the inference engine's slot cache, ``megatrain/inference/engine/slot_cache.py``: many sequences of
    different lengths in fixed storage). :class:`SelfAttention` hands it the rotated queries, keys and
    values and its :class:`CoreAttention` (for the window and the prefill's causal attention);
    :class:`KVCache` is the plain, one-batch cache."""

    @property
    @abstractmethod
    def length(self) -> int:
        """The longest sequence's tokens stored before this forward (what a model reads as ``past``)."""

    @abstractmethod
    def layer_length(self, layer_number: int) -> int:
        """Tokens a layer's queries count as ``past`` (0 in a prefill)."""

    @abstractmethod
    def attend(self, layer_number: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               core_attention: "CoreAttention") -> torch.Tensor:
        """Store k, v [b, groups, s, d] and return the attention of q [b, heads, s, d] -> [b, heads, s, d]."""


class SelfAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention through torch's SDPA: causal unless ``causal`` (by
    default the config's ``causal_attention``) is False."""

    def __init__(self, config: TransformerConfig, layer_number: int, causal: bool | None = None) -> None:
        super().__init__()
        assert config.kv_channels is not None and config.num_query_groups is not None
        self.layer_number = layer_number
        self.head_dim = config.kv_channels
        self.heads_per_group = config.heads_per_group
        self.attention_dropout = config.attention_dropout
        n, g, d, h = config.num_attention_heads, config.num_query_groups, config.kv_channels, config.hidden_size
        # Megatron: the QKV projection has a bias with --add-bias-linear or --add-qkv-bias.
        self.linear_qkv = nn.Linear(h, (n + 2 * g) * d, bias=config.add_bias_linear or config.add_qkv_bias)
        self.linear_proj = nn.Linear(n * d, h, bias=config.add_bias_linear)
        # --qk-layernorm: one norm of width d shared by every query head, one by every key head.
        self.q_layernorm: nn.Module | None = build_norm(config, d) if config.qk_layernorm else None
        self.k_layernorm: nn.Module | None = build_norm(config, d) if config.qk_layernorm else None
        # A parameter-free submodule so that parallel code can address the dropout region (its RNG)
        # and recompute it (selective activation recomputation) by module path.
        self.core_attention = CoreAttention(config, causal=causal, window=config.window_size)
        self.rotary = (
            RotaryEmbedding(config.rotary_dim, config.rotary_base, rope_scaling_of(config),
                            interleaved=bool(getattr(config, "rotary_interleaved", False)))
            if config.position_embedding_type == "rope"
            else None
        )

    def forward(
        self,
        x_bsh: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | FlexAttentionMask | None = None,
        kv_cache: KVCache | AttendingKVCache | None = None,
        *,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h].

        attention_mask: None for plain causal (or bidirectional) attention, else bool [b or 1, 1 or
        heads, s, past + s] with True where a query may attend to a key, or a float bias of that
        shape added to the scores (-inf where a query may not attend), or a FlexAttentionMask (the
        whole rule, through FlexAttention; no KV cache). position_ids [b or 1, s]
        drive the rotary angles; ``rotary`` gives their (cos, sin) tables already computed (the
        model computes them once).
        """
        b, s, _ = x_bsh.shape
        hpg, d = self.heads_per_group, self.head_dim
        past = kv_cache.layer_length(self.layer_number) if kv_cache is not None else 0

        # [b, s, groups, hpg + 2, d]: per group, hpg query heads then one key and one value head.
        qkv = self.linear_qkv(x_bsh).view(b, s, -1, hpg + 2, d)
        q = qkv[:, :, :, :hpg].reshape(b, s, -1, d).transpose(1, 2)  # [b, heads, s, d]
        k = qkv[:, :, :, hpg].transpose(1, 2)  # [b, groups, s, d]
        v = qkv[:, :, :, hpg + 1].transpose(1, 2)  # [b, groups, s, d]
        if self.q_layernorm is not None and self.k_layernorm is not None:  # before RoPE, as Megatron
            q, k = self.q_layernorm(q).to(v.dtype), self.k_layernorm(k).to(v.dtype)

        if self.rotary is not None:
            if rotary is None:
                if position_ids is None:
                    position_ids = torch.arange(past, past + s, device=x_bsh.device).unsqueeze(0)
                rotary = self.rotary(position_ids)
            cos, sin = rotary
            interleaved = self.rotary.interleaved
            # the first rotary_dim dims
            q, k = apply_rotary(q, cos, sin, interleaved), apply_rotary(k, cos, sin, interleaved)

        if isinstance(kv_cache, AttendingKVCache):  # the cache stores and attends (its own masks)
            out = kv_cache.attend(self.layer_number, q, k, v, self.core_attention)
        else:
            if kv_cache is not None:
                k, v = kv_cache.update(self.layer_number, k, v)  # now [b, groups, past + s, d]
            out = self.core_attention(q, k, v, attention_mask, past)  # [b, heads, s, d]
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, -1))


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + mask) v with attention dropout, through SDPA (no parameters).

    q [b, heads, s, d], k and v [b, groups, past + s, d] -> [b, heads, s, d]. ``causal``: without
    a mask, queries see earlier keys only (default: the config's ``causal_attention``); a mask given
    is the whole rule. ``window`` (LEFT, RIGHT), --window-size: query i (counted from the first
    cached key) also sees only keys i - LEFT ... i + RIGHT (-1: unbounded), as an SDPA boolean mask
    (or -inf in a float mask) on top of the causal rule or of the mask given; ``query_positions``
    [s] (keyword) are the queries' positions among the keys when they are not ``past ... past + s - 1``
    (context parallelism: a rank's sequence chunks against the whole sequence's keys). A
    :class:`FlexAttentionMask` runs FlexAttention instead of SDPA (no window, no cached keys, no
    attention dropout). ``softmax_scale``: the scores' factor instead of 1/sqrt(query dims)
    (multi-latent attention's YaRN correction); values may have fewer dims than queries and keys.
    """

    def __init__(self, config: TransformerConfig, causal: bool | None = None,
                 window: tuple[int, int] | None = None, softmax_scale: float | None = None) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale
        self.heads_per_group = config.heads_per_group
        self.attention_dropout = config.attention_dropout
        self.causal = config.causal_attention if causal is None else causal
        self.window = None if window is None or tuple(window) == (-1, -1) else tuple(window)

    def window_mask(self, positions: torch.Tensor, total: int, causal: bool) -> torch.Tensor:
        """bool [s, total]: True where the query at position ``positions[i]`` may see key j under the
        window (and causality)."""
        assert self.window is not None
        i = positions[:, None]
        j = torch.arange(total, device=positions.device)[None, :]
        left, right = self.window
        allowed = torch.ones(positions.shape[0], total, dtype=torch.bool, device=positions.device)
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        if causal:
            allowed &= j <= i
        return allowed

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | FlexAttentionMask | None,
        past: int,
        *,
        query_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(attention_mask, FlexAttentionMask):
            return self._flex(q, k, v, attention_mask, past)
        if isinstance(attention_mask, BiasedMask):
            if self.window is None and past == 0 and not (self.training and self.attention_dropout > 0):
                return attention_with_bias(q, k, v, attention_mask.mask, attention_mask.bias, attention_mask.keep,
                                           scale=self.softmax_scale)
            attention_mask = attention_mask.with_gradient()
        s = q.shape[2]
        if self.window is not None:
            if query_positions is None:
                query_positions = torch.arange(past, past + s, device=q.device)
            window = self.window_mask(query_positions, k.shape[2], causal=self.causal and attention_mask is None)
            if attention_mask is None:
                attention_mask = window
            elif attention_mask.dtype == torch.bool:
                attention_mask = attention_mask & window
            else:
                attention_mask = attention_mask.masked_fill(~window, float("-inf"))
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:  # an additive bias: SDPA takes it in the query's dtype
                attention_mask = attention_mask.to(q.dtype)
        elif self.causal and past > 0 and s > 1:
            # Several new queries after cached keys: causal, aligned to the last key.
            attention_mask = torch.ones(s, past + s, dtype=torch.bool, device=q.device).tril(diagonal=past)
        is_causal = self.causal and attention_mask is None and past == 0
        dropout_p = self.attention_dropout if self.training else 0.0

        scale = self.softmax_scale
        if self.heads_per_group == 1:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
            )
        if attention_mask is None:
            # Fused kernels read the shared key/value heads directly.
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=True, scale=scale
            )
        # With an explicit mask, not every torch >= 2.6 kernel takes enable_gqa: expand instead.
        # Query head j belongs to group j // (n/g), hence repeat_interleave.
        k = k.repeat_interleave(self.heads_per_group, dim=1)
        v = v.repeat_interleave(self.heads_per_group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=dropout_p, scale=scale)

    def _flex(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlexAttentionMask,
              past: int) -> torch.Tensor:
        if self.window is not None:
            raise ValueError("FlexAttention masks do not take --window-size here; use SDPA attention")
        if past:
            raise ValueError("FlexAttention masks do not take cached keys (incremental decoding uses SDPA)")
        if self.training and self.attention_dropout > 0:
            raise ValueError("FlexAttention has no attention dropout: use --attention-dropout 0 or SDPA attention")
        return flex_attention_forward(q, k, v, mask, enable_gqa=self.heads_per_group > 1, scale=self.softmax_scale)


class CrossAttention(nn.Module):
    """Queries from one sequence over the keys and values of another (the decoder over the encoder
    output), through SDPA; Megatron's ``CrossAttention``: no grouped-query form, no rotary positions.

    ``forward(x [b, s, h], context [b, s_ctx, h], context_mask)`` -> [b, s, h]; ``context_mask`` is
    None or bool [b or 1, 1, 1 or s, s_ctx] (True = the query may attend to that context position),
    or a FlexAttentionMask (through FlexAttention).
    """

    def __init__(self, config: TransformerConfig, layer_number: int) -> None:
        super().__init__()
        assert config.kv_channels is not None
        if config.num_query_groups != config.num_attention_heads:
            raise ValueError("--group-query-attention: cross-attention has one key/value head per query head "
                             "(as Megatron's CrossAttention)")
        if config.qk_layernorm:
            raise ValueError("--qk-layernorm is not implemented for cross-attention (encoder-decoder models)")
        self.layer_number = layer_number
        self.head_dim = config.kv_channels
        n, d, h = config.num_attention_heads, config.kv_channels, config.hidden_size
        self.linear_q = nn.Linear(h, n * d, bias=config.add_bias_linear)
        self.linear_kv = nn.Linear(h, 2 * n * d, bias=config.add_bias_linear)
        self.core_attention = CoreAttention(config, causal=False)
        self.linear_proj = nn.Linear(n * d, h, bias=config.add_bias_linear)

    def forward(self, x_bsh: torch.Tensor, context_bsh: torch.Tensor,
                context_mask: torch.Tensor | FlexAttentionMask | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """With ``kv_cache`` (incremental decoding) the context's keys and values are computed once
        and kept in it."""
        b, s, _ = x_bsh.shape
        d = self.head_dim
        q = self.linear_q(x_bsh).view(b, s, -1, d).transpose(1, 2)  # [b, heads, s, d]

        def keys_values() -> tuple[torch.Tensor, torch.Tensor]:
            kv = self.linear_kv(context_bsh).view(b, context_bsh.shape[1], -1, 2, d)  # per head: key, value
            return kv[:, :, :, 0].transpose(1, 2), kv[:, :, :, 1].transpose(1, 2)  # [b, heads, s_ctx, d]

        k, v = keys_values() if kv_cache is None else kv_cache.cross_attention(self.layer_number, keys_values)
        out = self.core_attention(q, k, v, context_mask, 0)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, -1))
