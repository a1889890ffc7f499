"""T5Model: Megatron-LM's T5 (an encoder-decoder transformer trained on span corruption) as plain
PyTorch.

Module paths are a contract shared with the parallelism, checkpoint and conversion code (Megatron's
names; the output layer sits at the top as in every megatrain family, Megatron's
``lm_head.output_layer``):

    embedding.{word_embeddings, position_embeddings}   one embedding for the encoder's and the
                                                       decoder's tokens (positions: learned_absolute only)
    encoder_relative_pos_emb.relative_attention_bias   [buckets, heads] (relative positions only)
    decoder_relative_pos_emb.relative_attention_bias
    encoder.layers["0"...]   pre-norm layers: bidirectional self-attention (encoder padding masked), MLP
    encoder.final_layernorm
    decoder.layers["0"...]   pre-norm layers: causal self-attention (decoder padding masked),
                             cross-attention over the encoder output (encoder padding masked), MLP
    decoder.final_layernorm
    output_layer.bias        tied to the word embeddings (the default) the output layer has a bias,
    output_layer.weight      untied (--untie-embeddings-and-output-weights) a weight and no bias,
                             as Megatron's T5LMHead

Attention scores are q k^T / sqrt(d) (Megatron's); with relative positions each stack's bias is
computed once per forward and added to every layer's self-attention scores. Padded keys are hidden
from every query (Megatron's padding masks as Transformer Engine and Hugging Face apply them), so no
row of scores is ever fully masked. Through SDPA the bias and the padding make one float mask [b,
heads, s, s] per stack; by default on CUDA with Triton (``T5Config.bias_gradient`` "auto", or
"recompute") SDPA reads that mask without a gradient and the bias gradient is recomputed apart
(:mod:`megatrain.models.common.bias_gradient`). Through FlexAttention (``T5Config.attention_backend``
"flex") the bias is a [heads, distances] table read by a score_mod and the padding a block mask,
built once per forward for all layers (:mod:`megatrain.models.common.flex_attention`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.models.common.attention import KVCache
from megatrain.models.common.bias_gradient import BiasedMask, biased_mask
from megatrain.models.common.embedding import Embedding
from megatrain.models.common.flex_attention import BLOCK_SIZE, FlexAttentionMask, flex_mask
from megatrain.models.common.heads import LogitsCrossEntropy, LossHead
from megatrain.models.common.init import (RESIDUAL_PROJECTIONS, canonical_parameter_name, megatron_initial_value,
                                          seeded_normal)
from megatrain.models.common.norms import build_norm
from megatrain.models.common.relative_position import RelativePositionBias, relative_position_bucket
from megatrain.models.common.rope import rotary_tables
from megatrain.models.common.transformer_layer import TransformerLayer
from megatrain.models.t5.config import T5Config, recomputes_bias_gradient

__all__ = ["T5Model", "T5Stack", "OutputLayer", "initial_value", "self_attention_mask", "padding_key_mask"]


class T5Stack(nn.Module):
    """``layers`` keyed by layer number, then ``final_layernorm`` (Megatron's TransformerBlock): the
    encoder (bidirectional) or the decoder (causal, with cross-attention)."""

    def __init__(self, config: T5Config, num_layers: int, *, decoder: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, layer_number=i, causal=decoder,
                                                              cross_attention=decoder)
                                     for i in range(num_layers)})
        self.final_layernorm = build_norm(config)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | FlexAttentionMask | None, *,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None, context: torch.Tensor | None = None,
                context_mask: torch.Tensor | FlexAttentionMask | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """``kv_cache``: incremental decoding (the decoder's keys and values so far; see ``T5Model.decode_step``)."""
        cache = {} if kv_cache is None else {"kv_cache": kv_cache}
        for layer in self.layers.values():
            hidden = layer(hidden, position_ids, attention_mask, rotary=rotary, context=context,
                           context_mask=context_mask, **cache)
        return self.final_layernorm(hidden)


class OutputLayer(nn.Module):
    """The vocabulary projection: tied, a ``bias`` [V] (the word embeddings, passed to ``forward``, are
    the weight); untied, a ``weight`` [V, h] and no bias."""

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        v, h = config.vocab_size, config.hidden_size
        untied = config.untie_embeddings_and_output_weights
        self.weight = nn.Parameter(torch.empty(v, h)) if untied else None
        self.bias = None if untied else nn.Parameter(torch.zeros(v))

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        assert weight is not None, "a tied output layer needs the word embeddings"
        return F.linear(hidden, weight, self.bias)


def padding_key_mask(padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[b, s] (nonzero = a real token) -> bool [b, 1, 1, s] (True = may be attended to), or None."""
    if padding_mask is None:
        return None
    return (padding_mask != 0).view(padding_mask.shape[0], 1, 1, padding_mask.shape[1])


def attention_keep(padding_mask: torch.Tensor | None, seq_length: int, *, causal: bool,
                   device: torch.device | None = None, force: bool = False) -> torch.Tensor | None:
    """bool [b or 1, 1, 1 or s, s], True where a query may attend to a key: padded keys hidden, later
    keys too when ``causal``. None where nothing is hidden; a causal rule alone is made explicit only
    with ``force`` (a float mask must carry it; plain causal attention needs no mask)."""
    keep = padding_key_mask(padding_mask)
    if causal and (keep is not None or force):
        device = padding_mask.device if padding_mask is not None else device
        earlier = torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).tril().view(
            1, 1, seq_length, seq_length)
        keep = earlier if keep is None else keep & earlier
    return keep


def self_attention_mask(padding_mask: torch.Tensor | None, seq_length: int, *, causal: bool,
                        bias: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """One stack's self-attention mask: padded keys hidden, later keys too when ``causal``; with a
    relative position ``bias`` [1, heads, s, s] the bias with -inf where a key is hidden (in ``dtype``).
    None where nothing is hidden and there is no bias (plain causal or bidirectional attention)."""
    keep = attention_keep(padding_mask, seq_length, causal=causal, device=None if bias is None else bias.device,
                          force=bias is not None)
    return keep if bias is None else biased_mask(bias, keep, dtype or bias.dtype)


class T5Model(nn.Module):
    """T5 for pre-training.

    ``forward(encoder_tokens [b, s_enc], decoder_tokens [b, s_dec], encoder_padding_mask,
    decoder_padding_mask)`` returns the logits [b, s_dec, V]; with ``labels`` [b, s_dec] (-100
    where nothing is predicted) the per-token loss [b, s_dec] in float32.

    ``loss_head`` (see :mod:`megatrain.models.common.heads`) turns the decoder's normed output and
    the labels into the per-token loss; parallel code may put the chunked or the vocab-parallel head
    there. ``encode`` and ``decode`` are the two halves (generation runs the encoder once, then
    ``decode_step`` per new token with a KV cache).
    """

    is_encoder_decoder = True  # generation: encode once, then decode_step (megatrain.inference.seq2seq)

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        relative = config.position_embedding_type == "relative"

        def relative_bias(bidirectional: bool) -> RelativePositionBias | None:
            if not relative:
                return None
            return RelativePositionBias(config.num_attention_heads, bidirectional=bidirectional,
                                        num_buckets=config.relative_attention_num_buckets,
                                        max_distance=config.relative_attention_max_distance)

        self.encoder_relative_pos_emb = relative_bias(bidirectional=True)
        self.decoder_relative_pos_emb = relative_bias(bidirectional=False)
        self.encoder = T5Stack(config, config.num_layers, decoder=False)
        self.decoder = T5Stack(config, config.decoder_layers, decoder=True)
        self.output_layer = OutputLayer(config)
        self.loss_head: LossHead = LogitsCrossEntropy()
        if not next(self.parameters()).is_meta:
            self.init_weights(seed=0)

    def layer_stacks(self) -> dict[str, nn.ModuleDict]:
        """The transformer layers by module path, in forward order (see models/common/layer_stacks.py)."""
        return {"encoder.layers": self.encoder.layers, "decoder.layers": self.decoder.layers}

    # ---- the pieces ---------------------------------------------------------------------------

    def _positions(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        if self.config.position_embedding_type == "learned_absolute" and s > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {s} tokens is longer than --max-position-embeddings "
                             f"({self.config.max_position_embeddings})")
        return torch.arange(s, device=tokens.device).unsqueeze(0)

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [b, s] -> hidden states [b, s, h] (in the autocast dtype under autocast)."""
        hidden = self.embedding(tokens, position_ids)
        if not self.config.fp32_residual_connection and torch.is_autocast_enabled(hidden.device.type):
            hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))
        return hidden

    def _mask(self, bias_table: RelativePositionBias | None, padding_mask: torch.Tensor | None,
              tokens: torch.Tensor, causal: bool) -> torch.Tensor | None:
        s = tokens.shape[1]
        if bias_table is None:
            return self_attention_mask(padding_mask, s, causal=causal)
        device_type = tokens.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        bias = bias_table(s, s, tokens.device)
        if (bias.requires_grad and torch.is_grad_enabled()
                and recomputes_bias_gradient(self.config.bias_gradient, bias.device)):
            keep = attention_keep(padding_mask, s, causal=causal, device=bias.device, force=True)
            return BiasedMask(biased_mask(bias.detach(), keep, dtype or bias.dtype), bias, keep)
        return self_attention_mask(padding_mask, s, causal=causal, bias=bias, dtype=dtype)

    def uses_flex_attention(self) -> bool:
        """Whether ``encode`` and ``decode`` run attention through FlexAttention (the config's
        ``attention_backend``)."""
        return self.config.uses_flex_attention()

    def _flex_mask(self, bias_table: RelativePositionBias | None, padding_mask: torch.Tensor | None,
                   tokens: torch.Tensor, causal: bool) -> FlexAttentionMask | None:
        """The FlexAttention form of :meth:`_mask` (None where nothing is hidden and there is no bias)."""
        s = tokens.shape[1]
        if bias_table is None and padding_mask is None:
            return None  # plain causal or bidirectional attention: SDPA's fused kernels
        bias = None
        if bias_table is not None:
            table, offset = bias_table.distance_bias(s, s, tokens.device, pad_to=BLOCK_SIZE)  # [heads, L]
            # One copy per batch row (a few MB): the backward kernel's atomic gradient adds then go to
            # b times more addresses (autograd sums the copies into the table's gradient).
            bias = (table.unsqueeze(0).expand(tokens.shape[0], -1, -1).contiguous(), offset)
        return flex_mask(None if padding_mask is None else padding_mask != 0, s, s, causal=causal,
                         device=tokens.device, position_bias=bias)

    def encode(self, encoder_tokens: torch.Tensor, encoder_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder token ids [b, s_enc] -> the encoder output [b, s_enc, h] (after its final norm)."""
        position_ids = self._positions(encoder_tokens)
        hidden = self.embed(encoder_tokens, position_ids)
        if self.uses_flex_attention():
            mask = self._flex_mask(self.encoder_relative_pos_emb, encoder_padding_mask, encoder_tokens, causal=False)
        else:
            mask = self._mask(self.encoder_relative_pos_emb, encoder_padding_mask, encoder_tokens, causal=False)
        return self.encoder(hidden, position_ids, mask, rotary=rotary_tables(self.config, position_ids))

    def decode(self, decoder_tokens: torch.Tensor, encoder_output: torch.Tensor,
               encoder_padding_mask: torch.Tensor | None = None,
               decoder_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder token ids [b, s_dec] and the encoder output -> the decoder's normed output [b, s_dec, h]."""
        position_ids = self._positions(decoder_tokens)
        hidden = self.embed(decoder_tokens, position_ids)
        mask: torch.Tensor | FlexAttentionMask | None
        context_mask: torch.Tensor | FlexAttentionMask | None
        if self.uses_flex_attention():
            mask = self._flex_mask(self.decoder_relative_pos_emb, decoder_padding_mask, decoder_tokens, causal=True)
            context_mask = None if encoder_padding_mask is None else flex_mask(
                encoder_padding_mask != 0, decoder_tokens.shape[1], encoder_output.shape[1], causal=False,
                device=decoder_tokens.device)
        else:
            mask = self._mask(self.decoder_relative_pos_emb, decoder_padding_mask, decoder_tokens, causal=True)
            context_mask = padding_key_mask(encoder_padding_mask)
        return self.decoder(hidden, position_ids, mask, rotary=rotary_tables(self.config, position_ids),
                            context=encoder_output, context_mask=context_mask)

    def decode_step(self, decoder_tokens: torch.Tensor, encoder_output: torch.Tensor,
                    encoder_padding_mask: torch.Tensor | None, kv_cache: KVCache) -> torch.Tensor:
        """Incremental decoding: the next decoder tokens [b, s] (usually one) after the
        ``kv_cache.length`` tokens already decoded -> the decoder's normed output [b, s, h]. Their
        self-attention keys and values join the cache; the cross-attention keys and values are computed
        from ``encoder_output`` on the first step and kept in the cache. The same outputs as ``decode``
        over the whole decoder input (no decoder padding: every decoded token is real)."""
        past, s = kv_cache.length, decoder_tokens.shape[1]
        cfg = self.config
        if cfg.position_embedding_type == "learned_absolute" and past + s > cfg.max_position_embeddings:
            raise ValueError(f"decoding {past + s} tokens goes beyond --max-position-embeddings "
                             f"({cfg.max_position_embeddings})")
        position_ids = torch.arange(past, past + s, device=decoder_tokens.device).unsqueeze(0)
        hidden = self.embed(decoder_tokens, position_ids)
        mask = None  # without a bias, the attention is causal by itself (aligned to the cached keys)
        table = self.decoder_relative_pos_emb
        if table is not None:
            query = position_ids[0][:, None]
            key = torch.arange(past + s, device=decoder_tokens.device)[None, :]
            buckets = relative_position_bucket(key - query, bidirectional=False, num_buckets=table.num_buckets,
                                               max_distance=table.max_distance)
            mask = table.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)  # [1, heads, s, past + s]
            if s > 1:
                mask = mask.masked_fill(key > query, float("-inf"))
        return self.decoder(hidden, position_ids, mask, rotary=rotary_tables(cfg, position_ids),
                            context=encoder_output, context_mask=padding_key_mask(encoder_padding_mask),
                            kv_cache=kv_cache)

    def output_weight(self) -> torch.Tensor:
        """The output layer's weight [V, h]: its own, or the word embeddings' when tied."""
        if self.output_layer.weight is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def output_bias(self) -> torch.Tensor | None:
        """The output layer's bias [V] (tied), or None (untied)."""
        return self.output_layer.bias

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The decoder's normed output [b, s, h] -> vocabulary logits [b, s, V]."""
        tied = None if self.output_layer.weight is not None else self.output_weight()
        return self.output_layer(hidden, tied)

    # ---- forward ------------------------------------------------------------------------------

    def forward(self, encoder_tokens: torch.Tensor, decoder_tokens: torch.Tensor,
                encoder_padding_mask: torch.Tensor | None = None, decoder_padding_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        encoder_output = self.encode(encoder_tokens, encoder_padding_mask)
        hidden = self.decode(decoder_tokens, encoder_output, encoder_padding_mask, decoder_padding_mask)
        if labels is None:
            return self.logits(hidden)
        return self.loss_head.per_token_loss(self, hidden, labels)

    # ---- parameters -----------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter with ``initial_value`` (also right after meta -> ``to_empty``)."""
        for name, param in self.named_parameters():
            param.copy_(initial_value(name, param.shape, self.config, seed))

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (a tied output weight counts once); ``exclude_embeddings`` leaves out
        the word and position embeddings and an untied output weight."""
        total = sum(p.numel() for p in self.parameters())
        if not exclude_embeddings:
            return total
        tables = [self.embedding.word_embeddings.weight, self.output_layer.weight,
                  self.embedding.position_embeddings.weight if self.embedding.position_embeddings is not None
                  else None]
        return total - sum(t.numel() for t in tables if t is not None)


# ---- deterministic initialisation ---------------------------------------------------------------

_STD_WEIGHTS = frozenset({"linear_qkv", "linear_q", "linear_kv", "linear_fc1", "word_embeddings",
                          "position_embeddings", "relative_attention_bias", "output_layer"})


def initial_value(name: str, shape: Sequence[int], config: T5Config, seed: int) -> torch.Tensor:
    """The initial value of T5 parameter ``name``: Megatron's rules (embeddings, the relative position
    tables and the input projections N(0, std); the residual projections ``linear_proj`` and
    ``linear_fc2`` N(0, std / sqrt(2 L)) with L the layers of their stack; biases 0, norms 1)."""
    canonical = canonical_parameter_name(name)
    parts = canonical.split(".")
    if parts[0] == "decoder" and parts[-1] == "weight" and parts[-2] in RESIDUAL_PROJECTIONS:
        return seeded_normal(canonical, shape, config.init_method_std / math.sqrt(2.0 * config.decoder_layers), seed)
    return megatron_initial_value(name, shape, config, seed, std_weights=_STD_WEIGHTS)
