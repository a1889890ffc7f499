"""Mapping between megatrain's T5Model and Hugging Face's ``T5ForConditionalGeneration`` (``model_type``
"t5").

Pure tensor and dict code (``transformers`` is not imported): configs go to and from the plain
``config.json`` dicts, state dicts to and from Hugging Face parameter names.

=================================================  ====================================================
megatrain                                          Hugging Face
=================================================  ====================================================
embedding.word_embeddings                          shared (= encoder/decoder.embed_tokens)
encoder_relative_pos_emb.relative_attention_bias   encoder.block.0.layer.0.SelfAttention.relative_attention_bias
decoder_relative_pos_emb.relative_attention_bias   decoder.block.0.layer.0.SelfAttention.relative_attention_bias
encoder.layers.N.input_layernorm                   encoder.block.N.layer.0.layer_norm
encoder.layers.N.self_attention.linear_qkv         encoder.block.N.layer.0.SelfAttention.{q,k,v}
encoder.layers.N.self_attention.linear_proj        encoder.block.N.layer.0.SelfAttention.o
encoder.layers.N.pre_mlp_layernorm                 encoder.block.N.layer.1.layer_norm
encoder.layers.N.mlp.linear_fc1                    encoder.block.N.layer.1.DenseReluDense.wi (gated: wi_0, wi_1)
encoder.layers.N.mlp.linear_fc2                    encoder.block.N.layer.1.DenseReluDense.wo
encoder.final_layernorm                            encoder.final_layer_norm
decoder.layers.N.input_layernorm, self_attention   decoder.block.N.layer.0.layer_norm, SelfAttention
decoder.layers.N.pre_cross_attn_layernorm          decoder.block.N.layer.1.layer_norm
decoder.layers.N.cross_attention.linear_q          decoder.block.N.layer.1.EncDecAttention.q
decoder.layers.N.cross_attention.linear_kv         decoder.block.N.layer.1.EncDecAttention.{k,v}
decoder.layers.N.cross_attention.linear_proj       decoder.block.N.layer.1.EncDecAttention.o
decoder.layers.N.pre_mlp_layernorm, mlp            decoder.block.N.layer.2.layer_norm, DenseReluDense
decoder.final_layernorm                            decoder.final_layer_norm
output_layer.weight (untied only)                  lm_head (tied: shared)
=================================================  ====================================================

What makes the two compute the same function:

- T5 has no biases, RMSNorm (``T5LayerNorm``: no mean, no bias) and relative positions only, so a model
  exports when it was trained with ``--position-embedding-type relative --normalization RMSNorm
  --disable-bias-linear``; anything else is refused with one line naming the flags.
- Hugging Face's attention does not scale its scores: Megatron's 1/sqrt(head dim) is folded into the
  query weights of self- and cross-attention (and multiplied back on import).
- Tied embeddings: Hugging Face multiplies the decoder output by d_model**-0.5 before ``lm_head``
  (``scale_decoder_outputs``); sqrt(d_model) is folded into the decoder's final norm. Megatron's
  tied output layer (T5LMHead) has a bias Hugging Face lacks: it is exported only when it is zero
  on every exported row. Untied (``--untie-embeddings-and-output-weights``): ``lm_head`` is the
  output weight, there is no bias and no scaling (T5 v1.1's layout).
- The MLP: GELU as ``"gelu"`` (exact) or ``"gelu_new"`` (tanh approximation), SwiGLU as
  ``"gated-silu"`` (our interleaved ``linear_fc1`` rows: gate ``wi_0``, up ``wi_1``). Hugging Face's
  ``"relu"`` (the original T5) and ``"gated-gelu"`` (T5 v1.1, Flan-T5) have no megatrain MLP and are
  refused on import.
- The folds are computed in float64: with sqrt(head dim) and sqrt(d_model) powers of two (head dim
  16, 64, 256; d_model 64, 256, 1024, ...) a round trip is bit-exact, otherwise within a rounding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from megatrain.models.common.hf_adapter import (ConfigFields, HFAdapter, HFTensors, UnsupportedModelError, fit_rows,
                                                qkv_join, qkv_split)
from megatrain.models.t5.config import T5Config

__all__ = ["ADAPTER", "ARCHITECTURE", "hf_architecture", "hf_config_dict", "t5_config_from_hf", "to_hf_state_dict",
           "from_hf_state_dict"]

ARCHITECTURE = "T5ForConditionalGeneration"
MODEL_TYPE = "t5"

# feed_forward_proj -> (swiglu, gelu_approximation); transformers maps a plain "gelu" to exact GELU and
# "gelu_new" / "gelu_pytorch_tanh" / "gelu_fast" to the tanh approximation.
_MLP_OF_HF = {"gated-silu": (True, "none"), "gelu": (False, "none"), "gelu_new": (False, "tanh"),
              "gelu_pytorch_tanh": (False, "tanh"), "gelu_fast": (False, "tanh")}

# T5Config's defaults, for keys a config.json leaves out.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_heads": 8,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "dropout_rate": 0.1,
    "layer_norm_epsilon": 1e-6, "feed_forward_proj": "relu", "n_positions": 512,
}


# ---------------------------------------------------------------------------------------------
# choosing the Hugging Face class
# ---------------------------------------------------------------------------------------------
def hf_architecture(cfg: T5Config) -> str:
    """T5ForConditionalGeneration; UnsupportedModelError naming every flag it cannot express.
    (Grouped-query attention never reaches here: T5Config refuses it.)"""
    needs = {
        "--position-embedding-type relative (T5's relative position buckets; not learned_absolute or rope)":
            cfg.position_embedding_type == "relative",
        "--normalization RMSNorm (T5LayerNorm: no mean, no bias)": cfg.normalization == "RMSNorm",
        "--disable-bias-linear (T5's linear layers have no biases)": not cfg.add_bias_linear,
        "no --add-qkv-bias (T5's attention has no biases)": not cfg.add_qkv_bias,
        "no --qk-layernorm": not cfg.qk_layernorm,
        "full attention (no --window-size)": cfg.window_size is None,
    }
    missing = [k for k, ok in needs.items() if not ok]
    if missing:
        raise UnsupportedModelError("this T5 model has no exact Hugging Face equivalent: "
                                    f"{ARCHITECTURE} needs " + "; ".join(missing))
    return ARCHITECTURE


def _feed_forward_proj(cfg: T5Config) -> str:
    if cfg.swiglu:
        return "gated-silu"
    return "gelu_new" if cfg.gelu_approximation == "tanh" else "gelu"


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------
def hf_config_dict(cfg: T5Config, architecture: str, *, vocab_size: int, dtype: str,
                   bos_token_id: int | None = None, eos_token_id: int | None = None,
                   pad_token_id: int | None = None, decoder_start_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` content for ``cfg`` with ``vocab_size`` rows. The decoder starts with
    ``decoder_start_token_id`` (default ``bos_token_id``: Megatron's decoder input begins with bos)."""
    if architecture != ARCHITECTURE:
        raise UnsupportedModelError(f"unknown architecture {architecture!r}")
    ids = {k: (v if v is not None and 0 <= v < vocab_size else None) for k, v in (
        ("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id),
        ("decoder_start_token_id", bos_token_id if decoder_start_token_id is None else decoder_start_token_id))}
    tied = not cfg.untie_embeddings_and_output_weights
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": vocab_size,
        "d_model": cfg.hidden_size,
        "d_kv": cfg.kv_channels,
        "d_ff": cfg.ffn_hidden_size,
        "num_layers": cfg.num_layers,
        "num_decoder_layers": cfg.decoder_layers,
        "num_heads": cfg.num_attention_heads,
        "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
        "relative_attention_max_distance": cfg.relative_attention_max_distance,
        "dropout_rate": cfg.hidden_dropout,
        "layer_norm_epsilon": cfg.norm_epsilon,
        "initializer_factor": 1.0,
        "feed_forward_proj": _feed_forward_proj(cfg),
        "is_encoder_decoder": True,
        "use_cache": True,
        # transformers < 5 reads the output scaling from tie_word_embeddings, transformers 5 from
        # scale_decoder_outputs (and loads lm_head from the file whenever it differs from shared)
        "tie_word_embeddings": tied,
        "scale_decoder_outputs": tied,
        "n_positions": cfg.max_position_embeddings,  # T5 has no position limit; kept for the way back
        **ids,
        "torch_dtype": dtype,
    }



def _scaled(hf: Mapping[str, Any]) -> bool:
    """Whether Hugging Face scales the decoder output by d_model**-0.5 (tied embeddings)."""
    value = hf.get("scale_decoder_outputs")
    if value is None:
        value = hf.get("tie_word_embeddings", True)
    return value is not False


def t5_config_from_hf(hf: Mapping[str, Any], vocab_size: int) -> tuple[T5Config, str]:
    """T5Config (with the padded ``vocab_size``) of a Hugging Face T5 config dict. A model that scales
    its decoder output (tied) becomes a tied T5 with a zero output bias; one that does not (T5 v1.1's
    layout) an untied one."""
    archs = [str(a) for a in (hf.get("architectures") or [])]
    if archs and ARCHITECTURE not in archs:
        raise UnsupportedModelError(f"architecture {archs!r} is not supported: megatrain's T5 converts {ARCHITECTURE} "
                                    "(the encoder, the decoder and the language-model head)")
    if hf.get("is_encoder_decoder") is False or hf.get("is_decoder"):
        raise UnsupportedModelError("is_encoder_decoder false / is_decoder true: megatrain's T5 is the whole "
                                    "encoder-decoder")
    fields = ConfigFields(hf, _HF_DEFAULTS)
    proj = fields.get("feed_forward_proj")
    if proj not in _MLP_OF_HF:
        why = {"relu": "the original T5's ReLU MLP", "gated-gelu": "T5 v1.1's / Flan-T5's gated GELU"}.get(
            proj, "this activation")
        raise UnsupportedModelError(
            f"feed_forward_proj {proj!r} ({why}) has no megatrain MLP: megatrain's T5 computes GELU (\"gelu\", "
            "\"gelu_new\") or SwiGLU (\"gated-silu\", --swiglu)")
    swiglu, gelu = _MLP_OF_HF[proj]
    dropout = fields.number("dropout_rate", float)
    try:
        cfg = T5Config(
            num_layers=fields.number("num_layers", int),
            decoder_num_layers=fields.number("num_decoder_layers", int) if hf.get("num_decoder_layers") is not None
            else None,
            hidden_size=fields.number("d_model", int), num_attention_heads=fields.number("num_heads", int),
            kv_channels=fields.number("d_kv", int), ffn_hidden_size=fields.number("d_ff", int), vocab_size=vocab_size,
            max_position_embeddings=fields.number("n_positions", int), position_embedding_type="relative",
            relative_attention_num_buckets=fields.number("relative_attention_num_buckets", int),
            relative_attention_max_distance=fields.number("relative_attention_max_distance", int),
            normalization="RMSNorm", norm_epsilon=fields.number("layer_norm_epsilon", float), swiglu=swiglu,
            gelu_approximation=gelu, add_bias_linear=False, untie_embeddings_and_output_weights=not _scaled(hf),
            hidden_dropout=dropout, attention_dropout=dropout)
    except ValueError as e:
        if isinstance(e, UnsupportedModelError):
            raise
        raise UnsupportedModelError(f"config.json describes no valid T5: {e}") from None
    return cfg, ARCHITECTURE


# ---------------------------------------------------------------------------------------------
# state dicts
# ---------------------------------------------------------------------------------------------
def _scaled_copy(w: torch.Tensor, factor: float) -> torch.Tensor:
    return (w.double() * factor).to(w.dtype)


def _kv_split(w: torch.Tensor, cfg: T5Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-attention ``linear_kv`` [2 n d, h] (rows [n, 2, d]: per head its key, then its value) -> k, v."""
    n, d = cfg.num_attention_heads, cfg.kv_channels
    grouped = w.reshape(n, 2, d, w.shape[-1])
    return grouped[:, 0].reshape(n * d, -1), grouped[:, 1].reshape(n * d, -1)


def _kv_join(k: torch.Tensor, v: torch.Tensor, cfg: T5Config) -> torch.Tensor:
    n, d = cfg.num_attention_heads, cfg.kv_channels
    return torch.stack([k.reshape(n, d, -1), v.reshape(n, d, -1)], dim=1).reshape(2 * n * d, -1)


def _mlp_names(cfg: T5Config) -> tuple[str, ...]:
    return ("wi_0", "wi_1") if cfg.swiglu else ("wi",)


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: T5Config, architecture: str,
                     vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Our state dict (canonical names, full tensors) -> Hugging Face names and layouts, ``vocab_size``
    rows of the embedding (and of an untied lm_head). UnsupportedModelError when the tied output bias
    is not zero on those rows."""
    hf_architecture(cfg)
    rows = vocab_size or cfg.vocab_size
    h, d = cfg.hidden_size, cfg.kv_channels
    tied = not cfg.untie_embeddings_and_output_weights
    if tied:
        bias = sd["output_layer.bias"][:rows]
        if bias.any():
            raise UnsupportedModelError(
                f"the output layer's bias (Megatron's T5LMHead has one with tied embeddings) is not zero (max |b| = "
                f"{bias.abs().max().item():.3g}): {ARCHITECTURE}'s lm_head has no bias; a T5 trained with "
                "--untie-embeddings-and-output-weights has none and exports")
    q_scale = 1.0 / math.sqrt(d)

    def norm(name: str) -> torch.Tensor:
        return sd[name] + 1 if cfg.apply_layernorm_1p else sd[name]

    out: dict[str, torch.Tensor] = {"shared.weight": fit_rows(sd["embedding.word_embeddings.weight"], rows)}
    for stack, layers in (("encoder", cfg.num_layers), ("decoder", cfg.decoder_layers)):
        out[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = \
            sd[f"{stack}_relative_pos_emb.relative_attention_bias.weight"]
        for i in range(layers):
            p, q = f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer."
            wq, wk, wv = qkv_split(sd[p + "self_attention.linear_qkv.weight"], cfg)
            out[q + "0.layer_norm.weight"] = norm(p + "input_layernorm.weight")
            out[q + "0.SelfAttention.q.weight"] = _scaled_copy(wq, q_scale)
            out[q + "0.SelfAttention.k.weight"], out[q + "0.SelfAttention.v.weight"] = wk, wv
            out[q + "0.SelfAttention.o.weight"] = sd[p + "self_attention.linear_proj.weight"]
            ff = "1"
            if stack == "decoder":
                ck, cv = _kv_split(sd[p + "cross_attention.linear_kv.weight"], cfg)
                out[q + "1.layer_norm.weight"] = norm(p + "pre_cross_attn_layernorm.weight")
                out[q + "1.EncDecAttention.q.weight"] = _scaled_copy(sd[p + "cross_attention.linear_q.weight"], q_scale)
                out[q + "1.EncDecAttention.k.weight"], out[q + "1.EncDecAttention.v.weight"] = ck, cv
                out[q + "1.EncDecAttention.o.weight"] = sd[p + "cross_attention.linear_proj.weight"]
                ff = "2"
            out[q + ff + ".layer_norm.weight"] = norm(p + "pre_mlp_layernorm.weight")
            fc1 = sd[p + "mlp.linear_fc1.weight"]
            parts = (fc1[0::2], fc1[1::2]) if cfg.swiglu else (fc1,)  # interleaved gate / up rows
            for name, w in zip(_mlp_names(cfg), parts):
                out[q + f"{ff}.DenseReluDense.{name}.weight"] = w
            out[q + f"{ff}.DenseReluDense.wo.weight"] = sd[p + "mlp.linear_fc2.weight"]
    out["encoder.final_layer_norm.weight"] = norm("encoder.final_layernorm.weight")
    final = norm("decoder.final_layernorm.weight")
    out["decoder.final_layer_norm.weight"] = _scaled_copy(final, math.sqrt(h)) if tied else final
    if not tied:
        out["lm_head.weight"] = fit_rows(sd["output_layer.weight"], rows)
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_state_dict(hf: Mapping[str, torch.Tensor], cfg: T5Config, architecture: str) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> our canonical state dict for ``cfg`` (vocabulary zero-padded to cfg's size).

    Raises UnsupportedModelError on missing or unexpected tensors, so nothing is silently dropped."""
    tensors = HFTensors(hf)
    take = tensors.take

    vocab, h, d = cfg.vocab_size, cfg.hidden_size, cfg.kv_channels
    tied = not cfg.untie_embeddings_and_output_weights
    shared = take("shared.weight")
    for copy in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight") + (("lm_head.weight",) if tied else ()):
        if copy in hf:  # copies of shared that some savers write
            if not torch.equal(take(copy), shared):
                raise UnsupportedModelError(
                    f"{copy} differs from shared.weight while config.json ties them (the decoder output scaled by "
                    "d_model**-0.5): megatrain's T5 has one embedding, tied to its output layer, or an untied output "
                    "layer without that scaling (tie_word_embeddings false)")
    q_scale = math.sqrt(d)
    sd: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": fit_rows(shared, vocab)}
    for stack, layers in (("encoder", cfg.num_layers), ("decoder", cfg.decoder_layers)):
        sd[f"{stack}_relative_pos_emb.relative_attention_bias.weight"] = \
            take(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
        for i in range(layers):
            p, q = f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer."
            sd[p + "input_layernorm.weight"] = take(q + "0.layer_norm.weight")
            sd[p + "self_attention.linear_qkv.weight"] = qkv_join(
                _scaled_copy(take(q + "0.SelfAttention.q.weight"), q_scale), take(q + "0.SelfAttention.k.weight"),
                take(q + "0.SelfAttention.v.weight"), cfg)
            sd[p + "self_attention.linear_proj.weight"] = take(q + "0.SelfAttention.o.weight")
            ff = "1"
            if stack == "decoder":
                sd[p + "pre_cross_attn_layernorm.weight"] = take(q + "1.layer_norm.weight")
                sd[p + "cross_attention.linear_q.weight"] = _scaled_copy(take(q + "1.EncDecAttention.q.weight"),
                                                                          q_scale)
                sd[p + "cross_attention.linear_kv.weight"] = _kv_join(take(q + "1.EncDecAttention.k.weight"),
                                                                       take(q + "1.EncDecAttention.v.weight"), cfg)
                sd[p + "cross_attention.linear_proj.weight"] = take(q + "1.EncDecAttention.o.weight")
                ff = "2"
            sd[p + "pre_mlp_layernorm.weight"] = take(q + ff + ".layer_norm.weight")
            parts = [take(q + f"{ff}.DenseReluDense.{name}.weight") for name in _mlp_names(cfg)]
            sd[p + "mlp.linear_fc1.weight"] = (torch.stack(parts, dim=1).reshape(-1, h) if cfg.swiglu
                                               else parts[0])
            sd[p + "mlp.linear_fc2.weight"] = take(q + f"{ff}.DenseReluDense.wo.weight")
    sd["encoder.final_layernorm.weight"] = take("encoder.final_layer_norm.weight")
    final = take("decoder.final_layer_norm.weight")
    if tied:
        sd["decoder.final_layernorm.weight"] = _scaled_copy(final, 1.0 / math.sqrt(h))
        sd["output_layer.bias"] = torch.zeros(vocab, dtype=shared.dtype)
    else:
        sd["decoder.final_layernorm.weight"] = final
        # transformers 5 writes no lm_head when it equals shared
        head = take("lm_head.weight") if "lm_head.weight" in hf else shared
        sd["output_layer.weight"] = fit_rows(head, vocab)
    tensors.refuse_leftovers("megatrain's T5")
    return {k: v.contiguous() for k, v in sd.items()}


def _accepts(hf: Mapping[str, Any]) -> bool:
    """T5 folders (other T5 classes too, refused later with their own message)."""
    archs = [str(a) for a in (hf.get("architectures") or [])]
    return hf.get("model_type") == MODEL_TYPE or any(a.startswith("T5") for a in archs)


def _special_token_ids(tokenizer: Any) -> dict[str, int | None]:
    """Megatron's T5 decoder input starts with the tokenizer's bos ([CLS] for WordPiece) and its labels
    end with eos ([SEP]); Hugging Face's decoder starts with decoder_start_token_id."""
    bos, eos = getattr(tokenizer, "bos", None), getattr(tokenizer, "eos", None)
    return {"bos_token_id": bos, "eos_token_id": eos if eos is not None else getattr(tokenizer, "eod", None),
            "pad_token_id": getattr(tokenizer, "pad", None), "decoder_start_token_id": bos}


def _family_flags(cfg: T5Config) -> list[str]:
    return ["--decoder-num-layers", str(cfg.decoder_layers), "--position-embedding-type", "relative",
            "--relative-attention-num-buckets", str(cfg.relative_attention_num_buckets),
            "--relative-attention-max-distance", str(cfg.relative_attention_max_distance)]


ADAPTER = HFAdapter(architectures=(ARCHITECTURE,), accepts=_accepts, architecture=hf_architecture,
                    config_dict=hf_config_dict, to_hf_state_dict=to_hf_state_dict, config_from_hf=t5_config_from_hf,
                    from_hf_state_dict=from_hf_state_dict, vocab_from_tokenizer=True, generation_config=True,
                    script="pretrain_t5.py", family_flags=_family_flags, special_token_ids=_special_token_ids,
                    tokenizer_config={"model_input_names": ["input_ids", "attention_mask"]})
