"""Mapping between megatrain's BertModel and Hugging Face's ``MegatronBertForPreTraining`` /
``MegatronBertForMaskedLM`` (``model_type`` "megatron-bert").

Pure tensor and dict code (``transformers`` is not imported): configs go to and from the plain
``config.json`` dicts, state dicts to and from Hugging Face parameter names.

Both are Megatron's pre-norm BERT, so the modules correspond one to one:

=============================================  ==============================================
megatrain                                      Hugging Face
=============================================  ==============================================
embedding.word_embeddings                      bert.embeddings.word_embeddings
embedding.position_embeddings                  bert.embeddings.position_embeddings
embedding.tokentype_embeddings                 bert.embeddings.token_type_embeddings
layers.N.input_layernorm                       bert.encoder.layer.N.attention.ln
layers.N.self_attention.linear_qkv             bert.encoder.layer.N.attention.self.{query,key,value}
layers.N.self_attention.linear_proj            bert.encoder.layer.N.attention.output.dense
layers.N.pre_mlp_layernorm                     bert.encoder.layer.N.ln
layers.N.mlp.linear_fc1 / linear_fc2           bert.encoder.layer.N.intermediate.dense / output.dense
final_layernorm                                bert.encoder.ln
pooler.dense                                   bert.pooler.dense
lm_head.dense / lm_head.layer_norm             cls.predictions.transform.dense / .LayerNorm
output_layer.bias                              cls.predictions.bias (= cls.predictions.decoder.bias)
output_layer.weight (untied only)              cls.predictions.decoder.weight (tied: the word embeddings)
binary_head                                    cls.seq_relationship
=============================================  ==============================================

Layouts and choices:

- ``linear_qkv``'s rows are Megatron's grouped layout ``[g, n/g + 2, d]``; Hugging Face has one
  projection each for queries, keys and values (and no grouped-query attention).
- One ``hidden_act`` serves the MLP and the masked-LM transform, as ``config.gelu_approximation``
  does here: exact GELU is "gelu", the tanh approximation is written as "gelu_pytorch_tanh" (and
  read from "gelu_pytorch_tanh", "gelu_new" or "gelu_fast", the same function).
- A model with the binary head is exported as ``MegatronBertForPreTraining``; one without it as
  ``MegatronBertForMaskedLM``, which has neither the pooler nor the sentence-order head (nothing is
  invented). Hugging Face always adds token-type embeddings: a model without token types gets
  ``type_vocab_size`` 2 of zeros, so the segment ids a BERT tokenizer gives change nothing. Importing
  ``MegatronBertForMaskedLM`` gives a BERT without the binary head, and so without token types:
  token-type rows that are all equal are added to the position embeddings (the same sum for every
  token); rows that differ are refused.
- The vocabulary rows are trimmed to (export) or zero-padded up to (import) the requested size.
- Weights of ``--apply-layernorm-1p`` are written as ``1 + weight``; a model trained with
  ``--disable-bias-linear`` gets zero biases (Hugging Face always has them): the same function.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megatrain.models.bert.config import BertConfig
from megatrain.models.common.hf_adapter import (ConfigFields, HFAdapter, HFTensors, UnsupportedModelError, fit_rows,
                                                qkv_join, qkv_split)

__all__ = ["ADAPTER", "PRETRAINING", "MASKED_LM", "hf_architecture", "hf_config_dict", "bert_config_from_hf",
           "to_hf_state_dict", "from_hf_state_dict"]

PRETRAINING = "MegatronBertForPreTraining"
MASKED_LM = "MegatronBertForMaskedLM"
SUPPORTED_ARCHITECTURES = (PRETRAINING, MASKED_LM)
MODEL_TYPE = "megatron-bert"

# Hugging Face's names of the two GELUs (the tanh approximation has several, all the same function).
_GELU_OF_HF = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh"}
_HF_GELU = {"none": "gelu", "tanh": "gelu_pytorch_tanh"}

# MegatronBertConfig's defaults, for keys a config.json leaves out (as transformers reads it).
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 29056, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
    "intermediate_size": 4096, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
    "initializer_range": 0.02, "layer_norm_eps": 1e-12, "tie_word_embeddings": True,
}


# ---------------------------------------------------------------------------------------------
# choosing the Hugging Face class
# ---------------------------------------------------------------------------------------------
def hf_architecture(cfg: BertConfig) -> str:
    """MegatronBertForPreTraining (binary head) or MegatronBertForMaskedLM; UnsupportedModelError
    naming every flag Hugging Face's MegatronBert cannot express."""
    assert cfg.kv_channels is not None and cfg.num_query_groups is not None
    needs = {
        "learned absolute positions (not --position-embedding-type rope)":
            cfg.position_embedding_type == "learned_absolute",
        "LayerNorm (not --normalization RMSNorm)": cfg.normalization == "LayerNorm",
        "a GELU MLP (not --swiglu)": not cfg.swiglu,
        "no grouped-query attention (--num-query-groups equal to --num-attention-heads)":
            cfg.num_query_groups == cfg.num_attention_heads,
        "head dim = hidden / heads (no --kv-channels)": cfg.kv_channels * cfg.num_attention_heads == cfg.hidden_size,
        "no --qk-layernorm": not cfg.qk_layernorm,
        "no --add-qkv-bias without the other biases": cfg.add_bias_linear or not cfg.add_qkv_bias,
        "full attention (no --window-size)": cfg.window_size is None,
    }
    architecture = PRETRAINING if cfg.add_binary_head else MASKED_LM
    missing = [k for k, ok in needs.items() if not ok]
    if missing:
        raise UnsupportedModelError(f"this BERT model has no exact Hugging Face equivalent: {architecture} needs "
                                    + "; ".join(missing))
    return architecture


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------
def hf_config_dict(cfg: BertConfig, architecture: str, *, vocab_size: int, dtype: str,
                   bos_token_id: int | None = None, eos_token_id: int | None = None,
                   pad_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` content for ``cfg`` exported as ``architecture`` with ``vocab_size`` rows."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"unknown architecture {architecture!r}")
    if pad_token_id is not None and not 0 <= pad_token_id < vocab_size:
        pad_token_id = None  # Hugging Face's embedding takes it as its padding_idx
    return {
        "architectures": [architecture],
        "model_type": MODEL_TYPE,
        "vocab_size": vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.ffn_hidden_size,
        "hidden_act": _HF_GELU[cfg.gelu_approximation],
        "hidden_dropout_prob": cfg.hidden_dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout,
        "max_position_embeddings": cfg.max_position_embeddings,
        "position_embedding_type": "absolute",
        "type_vocab_size": cfg.num_tokentypes if cfg.num_tokentypes > 0 else 2,
        "initializer_range": cfg.init_method_std,
        "layer_norm_eps": cfg.norm_epsilon,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "is_decoder": False,
        "add_cross_attention": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "torch_dtype": dtype,
    }


def _architecture_of(hf: Mapping[str, Any]) -> str:
    archs = [str(a) for a in (hf.get("architectures") or [])]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if not archs and hf.get("model_type") == MODEL_TYPE:
        return PRETRAINING
    found = archs or hf.get("model_type")
    if hf.get("model_type") == "bert" or any(a.startswith("Bert") for a in archs):
        raise UnsupportedModelError(
            f"architecture {found!r} is the original post-norm BERT (a LayerNorm after each sublayer and on the "
            "embeddings); megatrain's BERT is Megatron's pre-norm one: it converts "
            + " and ".join(SUPPORTED_ARCHITECTURES))
    raise UnsupportedModelError(
        f"architecture {found!r} is not supported: megatrain's BERT converts {' and '.join(SUPPORTED_ARCHITECTURES)} "
        "(the pre-training heads; the masked-LM head alone)")



def bert_config_from_hf(hf: Mapping[str, Any], vocab_size: int) -> tuple[BertConfig, str]:
    """BertConfig (with the padded ``vocab_size``) and the architecture of a Hugging Face config dict."""
    arch = _architecture_of(hf)
    position = hf.get("position_embedding_type") or "absolute"
    if position != "absolute":
        raise UnsupportedModelError(
            f"position_embedding_type {position!r}: megatrain's BERT has learned absolute positions only "
            "(\"absolute\")")
    if hf.get("is_decoder"):
        raise UnsupportedModelError("is_decoder=true: a causal MegatronBert; megatrain's BERT attends both ways")
    if hf.get("add_cross_attention"):
        raise UnsupportedModelError("add_cross_attention=true: megatrain's BERT has no cross-attention")
    fields = ConfigFields(hf, _HF_DEFAULTS)
    act = fields.get("hidden_act")
    if not isinstance(act, str) or act not in _GELU_OF_HF:
        raise UnsupportedModelError(
            f"hidden_act {act!r}: megatrain's BERT computes exact GELU (\"gelu\") or its tanh approximation "
            "(\"gelu_pytorch_tanh\", \"gelu_new\", \"gelu_fast\")")
    hidden, heads = fields.number("hidden_size", int), fields.number("num_attention_heads", int)
    if heads <= 0 or hidden % heads:
        raise UnsupportedModelError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    binary_head = arch == PRETRAINING
    type_vocab = fields.number("type_vocab_size", int)
    if binary_head and type_vocab != 2:
        raise UnsupportedModelError(
            f"type_vocab_size {type_vocab}: megatrain's BERT with the binary head has two token types (Megatron's)")
    if type_vocab <= 0:
        raise UnsupportedModelError(f"type_vocab_size {type_vocab}: expected at least 1")
    try:
        cfg = BertConfig(
            num_layers=fields.number("num_hidden_layers", int), hidden_size=hidden, num_attention_heads=heads,
            vocab_size=vocab_size, max_position_embeddings=fields.number("max_position_embeddings", int),
            ffn_hidden_size=fields.number("intermediate_size", int), position_embedding_type="learned_absolute",
            normalization="LayerNorm", norm_epsilon=fields.number("layer_norm_eps", float), swiglu=False,
            gelu_approximation=_GELU_OF_HF[act], add_bias_linear=True,
            untie_embeddings_and_output_weights=not bool(fields.get("tie_word_embeddings")),
            hidden_dropout=fields.number("hidden_dropout_prob", float),
            attention_dropout=fields.number("attention_probs_dropout_prob", float),
            init_method_std=fields.number("initializer_range", float),
            add_binary_head=binary_head, num_tokentypes=2 if binary_head else 0)
    except ValueError as e:
        if isinstance(e, UnsupportedModelError):
            raise
        raise UnsupportedModelError(f"config.json describes no valid BERT: {e}") from None
    return cfg, arch


# ---------------------------------------------------------------------------------------------
# state dicts
# ---------------------------------------------------------------------------------------------
_NORMS = (("input_layernorm", "attention.ln"), ("pre_mlp_layernorm", "ln"))
_LINEARS = (("self_attention.linear_proj", "attention.output.dense"), ("mlp.linear_fc1", "intermediate.dense"),
            ("mlp.linear_fc2", "output.dense"))
_HEAD = (("lm_head.dense", "cls.predictions.transform.dense"),
         ("lm_head.layer_norm", "cls.predictions.transform.LayerNorm"))
_BINARY = (("pooler.dense", "bert.pooler.dense"), ("binary_head", "cls.seq_relationship"))


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: BertConfig, architecture: str,
                     vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Our state dict (canonical names, full tensors) -> Hugging Face names and layouts.

    ``vocab_size`` trims (or zero-pads) the embedding, output weight and output bias rows. A tied
    output weight is not written (``tie_word_embeddings`` restores it).
    """
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"unknown architecture {architecture!r}")
    rows = vocab_size or cfg.vocab_size
    h = cfg.hidden_size
    word = fit_rows(sd["embedding.word_embeddings.weight"], rows)

    def norm(name: str) -> torch.Tensor:  # the encoder's norms scale by 1 + weight under --apply-layernorm-1p
        return sd[name] + 1 if cfg.apply_layernorm_1p and name.endswith(".weight") else sd[name]

    def bias(name: str, width: int) -> torch.Tensor:
        return sd[name] if name in sd else torch.zeros(width, dtype=word.dtype)

    out: dict[str, torch.Tensor] = {
        "bert.embeddings.word_embeddings.weight": word,
        "bert.embeddings.position_embeddings.weight": sd["embedding.position_embeddings.weight"],
        "bert.embeddings.token_type_embeddings.weight": sd.get(
            "embedding.tokentype_embeddings.weight", torch.zeros(2, h, dtype=word.dtype)),
    }
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"bert.encoder.layer.{i}."
        for ours, theirs in _NORMS:
            out[q + theirs + ".weight"] = norm(p + ours + ".weight")
            out[q + theirs + ".bias"] = norm(p + ours + ".bias")
        wq, wk, wv = qkv_split(sd[p + "self_attention.linear_qkv.weight"], cfg)
        bq, bk, bv = qkv_split(bias(p + "self_attention.linear_qkv.bias", 3 * h), cfg)
        for name, w, b in (("query", wq, bq), ("key", wk, bk), ("value", wv, bv)):
            out[q + f"attention.self.{name}.weight"], out[q + f"attention.self.{name}.bias"] = w, b
        for ours, theirs in _LINEARS:
            w = sd[p + ours + ".weight"]
            out[q + theirs + ".weight"] = w
            out[q + theirs + ".bias"] = bias(p + ours + ".bias", w.shape[0])
    out["bert.encoder.ln.weight"] = norm("final_layernorm.weight")
    out["bert.encoder.ln.bias"] = norm("final_layernorm.bias")
    for ours, theirs in _HEAD + (_BINARY if architecture == PRETRAINING else ()):
        out[theirs + ".weight"], out[theirs + ".bias"] = sd[ours + ".weight"], sd[ours + ".bias"]
    out["cls.predictions.bias"] = fit_rows(sd["output_layer.bias"], rows)
    if cfg.untie_embeddings_and_output_weights:  # untied, Hugging Face's decoder keeps a bias of its own
        out["cls.predictions.decoder.weight"] = fit_rows(sd["output_layer.weight"], rows)
        out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"].clone()
    return {k: v.contiguous() for k, v in out.items()}


# Hugging Face keys that hold no parameters (older files store the position-id buffer).
_IGNORED_SUFFIXES = ("embeddings.position_ids",)


def from_hf_state_dict(hf: Mapping[str, torch.Tensor], cfg: BertConfig, architecture: str) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> our canonical state dict for ``cfg`` (vocabulary zero-padded to cfg's size).

    Raises UnsupportedModelError on missing or unexpected tensors, so nothing is silently dropped.
    """
    hf = {k: v for k, v in hf.items() if not k.endswith(_IGNORED_SUFFIXES)}
    tensors = HFTensors(hf)
    take = tensors.take

    def first(*names: str) -> torch.Tensor:
        tensors.mark(*names)
        present = [n for n in names if n in hf]
        return take(present[0] if present else names[0])

    vocab = cfg.vocab_size
    sd: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": fit_rows(take("bert.embeddings.word_embeddings.weight"), vocab),
    }
    position = take("bert.embeddings.position_embeddings.weight")
    token_types = take("bert.embeddings.token_type_embeddings.weight")
    if cfg.num_tokentypes > 0:
        sd["embedding.tokentype_embeddings.weight"] = token_types
    elif token_types.numel():
        # No token types here (Megatron's BERT without the binary head): every token gets the same
        # token-type row only if all rows are equal; then it joins the position embeddings.
        if not torch.equal(token_types, token_types[:1].expand_as(token_types)):
            raise UnsupportedModelError(
                f"bert.embeddings.token_type_embeddings: the {token_types.shape[0]} rows (type_vocab_size) differ, "
                f"but megatrain's BERT without the binary head ({architecture}) has no token types (as Megatron's "
                "--bert-no-binary-head)")
        if token_types[0].any():
            position = position + token_types[0]
    sd["embedding.position_embeddings.weight"] = position
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"bert.encoder.layer.{i}."
        for ours, theirs in _NORMS:
            sd[p + ours + ".weight"] = take(q + theirs + ".weight")
            sd[p + ours + ".bias"] = take(q + theirs + ".bias")
        for part in ("weight", "bias"):
            sd[p + f"self_attention.linear_qkv.{part}"] = qkv_join(
                *(take(q + f"attention.self.{name}.{part}") for name in ("query", "key", "value")), cfg)
        for ours, theirs in _LINEARS:
            sd[p + ours + ".weight"] = take(q + theirs + ".weight")
            sd[p + ours + ".bias"] = take(q + theirs + ".bias")
    sd["final_layernorm.weight"] = take("bert.encoder.ln.weight")
    sd["final_layernorm.bias"] = take("bert.encoder.ln.bias")
    for ours, theirs in _HEAD + (_BINARY if cfg.add_binary_head else ()):
        sd[ours + ".weight"], sd[ours + ".bias"] = take(theirs + ".weight"), take(theirs + ".bias")
    if cfg.untie_embeddings_and_output_weights:
        sd["output_layer.weight"] = fit_rows(take("cls.predictions.decoder.weight"), vocab)
        # the untied decoder's own bias is the one Hugging Face's forward adds
        sd["output_layer.bias"] = fit_rows(first("cls.predictions.decoder.bias", "cls.predictions.bias"), vocab)
    else:
        sd["output_layer.bias"] = fit_rows(first("cls.predictions.bias", "cls.predictions.decoder.bias"), vocab)
        tensors.mark("cls.predictions.decoder.weight")  # a tied copy some savers write
    tensors.refuse_leftovers(f"megatrain's BERT ({architecture})")
    return {k: v.contiguous() for k, v in sd.items()}


def _accepts(hf: Mapping[str, Any]) -> bool:
    """MegatronBert folders (also the classes refused later, for their own message) and the original BERT's."""
    archs = [str(a) for a in (hf.get("architectures") or [])]
    return (hf.get("model_type") in (MODEL_TYPE, "bert")
            or any(a.startswith(("MegatronBert", "Bert")) for a in archs))


def _family_flags(cfg: BertConfig) -> list[str]:
    return [] if cfg.add_binary_head else ["--bert-no-binary-head"]


ADAPTER = HFAdapter(architectures=SUPPORTED_ARCHITECTURES, accepts=_accepts, architecture=hf_architecture,
                    config_dict=hf_config_dict, to_hf_state_dict=to_hf_state_dict, config_from_hf=bert_config_from_hf,
                    from_hf_state_dict=from_hf_state_dict, vocab_from_tokenizer=True, generation_config=False,
                    script="pretrain_bert.py", family_flags=_family_flags)
