"""Mapping between megatrain's GPTModel and Hugging Face's GPT2LMHeadModel, LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM, and (with --num-experts; the MoE part is
:mod:`megatrain.models.gpt.hf_moe`) MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM.

Pure tensor and dict code (``transformers`` is not imported): configs go to and from the plain
``config.json`` dicts, state dicts to and from Hugging Face parameter names.

Layouts that differ:

- GPT-2's ``Conv1D`` stores weights as [in, out] (transposed from ``nn.Linear``); its fused
  ``c_attn`` holds all queries, then all keys, then all values, while our ``linear_qkv`` rows are
  grouped per head as ``[g, n/g + 2, d]`` (queries of a group, its key, its value).
- LLaMA has separate ``q_proj/k_proj/v_proj`` and ``gate_proj/up_proj``; our ``linear_fc1`` rows are
  interleaved (row 2i = gate i, row 2i + 1 = up i). Mistral, Qwen2 and Qwen3 share LLaMA's names:
  Mistral is LLaMA without biases; Qwen2 has a bias on q/k/v only (``--disable-bias-linear
  --add-qkv-bias``); Qwen3 adds ``q_norm``/``k_norm`` (our ``self_attention.q_layernorm`` /
  ``k_layernorm``, ``--qk-layernorm``) and a free head dim (``head_dim``, ``--kv-channels``).

Llama 3.x RoPE scaling (``rope_type: "llama3"`` in ``rope_scaling`` / ``rope_parameters``) is
``--use-rope-scaling`` and its factors, for LlamaForCausalLM only; other scaling types are refused.

Hugging Face's RoPE pairs the two halves of a head (dims i and i + d/2). A ``--rotary-interleaved``
model (pairs 2i, 2i + 1) exports with the query and key rows of each head (and the q/k norm weights)
reordered, even dims first: the same attention scores under the half layout. Imports are half layout.

With ``--multi-latent-attention``: DeepseekV3ForCausalLM (:mod:`megatrain.models.gpt.hf_deepseek`).

A model that neither class represents exactly is refused with :class:`UnsupportedModelError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megatrain.models.common.hf_adapter import (HFAdapter, HFTensors, UnsupportedModelError, fit_rows, qkv_join,
                                                qkv_split)
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt.hf_deepseek import (DEEPSEEK_V3, deepseek_architecture, deepseek_config_dict,
                                              deepseek_config_from_hf, deepseek_from_hf_state_dict,
                                              deepseek_pretrain_flags, deepseek_to_hf_state_dict)
from megatrain.models.gpt.hf_moe import (CLASS_DEFAULTS, DENSE_TWIN, MOE_ARCHITECTURES, MOE_MODEL_TYPES, QWEN2_MOE,
                                         QWEN3_MOE, is_moe, moe_architecture, moe_config_entries, moe_fields_from_hf,
                                         moe_layers, moe_mlp_from_hf, moe_mlp_to_hf, moe_pretrain_flags,
                                         moe_window_size)

GPT2 = "GPT2LMHeadModel"
LLAMA = "LlamaForCausalLM"
MISTRAL = "MistralForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
SUPPORTED_ARCHITECTURES = (GPT2, LLAMA, MISTRAL, QWEN2, QWEN3, *MOE_ARCHITECTURES, DEEPSEEK_V3)
_LLAMA_LIKE = (LLAMA, MISTRAL, QWEN2, QWEN3, *MOE_ARCHITECTURES)
_MODEL_TYPES = {"gpt2": GPT2, "llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3, **MOE_MODEL_TYPES,
                "deepseek_v3": DEEPSEEK_V3}




# ---------------------------------------------------------------------------------------------
# choosing the Hugging Face class
# ---------------------------------------------------------------------------------------------
def _sliding_window(cfg: GPTConfig) -> int | None:
    """Hugging Face's ``sliding_window`` (keys a query sees, itself included) of a causal model with
    ``--window-size LEFT,RIGHT``: LEFT + 1 (RIGHT changes nothing under the causal rule); None: full."""
    if cfg.window_size is None or cfg.window_size[0] < 0:
        return None
    return cfg.window_size[0] + 1


def hf_architecture(cfg: GPTConfig) -> str:
    """GPT2LMHeadModel or LlamaForCausalLM for ``cfg``; raises UnsupportedModelError otherwise."""
    if cfg.multi_latent_attention:
        return deepseek_architecture(cfg)
    assert cfg.kv_channels is not None and cfg.num_query_groups is not None
    gpt2_needs = {
        "learned absolute positions (--position-embedding-type learned_absolute)":
            cfg.position_embedding_type == "learned_absolute",
        "LayerNorm (--normalization LayerNorm)": cfg.normalization == "LayerNorm",
        "a GELU MLP (no --swiglu)": not cfg.swiglu,
        "no grouped-query attention": cfg.num_query_groups == cfg.num_attention_heads,
        "head dim = hidden / heads (no --kv-channels)": cfg.kv_channels * cfg.num_attention_heads == cfg.hidden_size,
        "no --qk-layernorm": not cfg.qk_layernorm,
        "full attention (no --window-size)": _sliding_window(cfg) is None,
    }
    llama_needs = {
        "rotary positions (--position-embedding-type rope)": cfg.position_embedding_type == "rope",
        "every head dim rotated (--rotary-percent 1.0)": cfg.rotary_percent == 1.0,
        "RMSNorm (--normalization RMSNorm)": cfg.normalization == "RMSNorm",
        "a SwiGLU MLP (--swiglu)": cfg.swiglu,
    }
    arch = _hf_architecture(cfg, gpt2_needs, llama_needs)
    if cfg.use_rope_scaling and arch != LLAMA:
        raise UnsupportedModelError(f"--use-rope-scaling (Llama 3.x RoPE scaling) exports as {LLAMA} only; this "
                                    f"model would be {arch}")
    return arch


def _hf_architecture(cfg: GPTConfig, gpt2_needs: dict[str, bool], llama_needs: dict[str, bool]) -> str:
    """The class the model's shape asks for (before the RoPE-scaling rule of :func:`hf_architecture`)."""
    if is_moe(cfg):
        llama_missing = [k for k, ok in llama_needs.items() if not ok]
        if llama_missing:
            raise UnsupportedModelError("a mixture-of-experts model exports as MixtralForCausalLM, Qwen2MoeForCausalLM "
                                        "or Qwen3MoeForCausalLM, which need " + "; ".join(llama_missing))
        return moe_architecture(cfg)
    if all(gpt2_needs.values()):
        return GPT2
    if all(llama_needs.values()):
        if cfg.qk_layernorm:
            if cfg.add_bias_linear or cfg.add_qkv_bias:
                raise UnsupportedModelError(
                    "--qk-layernorm exports as Qwen3ForCausalLM, which needs --disable-bias-linear without "
                    "--add-qkv-bias (its attention_bias would add an output-projection bias too)")
            return QWEN3
        if cfg.add_qkv_bias and not cfg.add_bias_linear:
            return QWEN2
        if _sliding_window(cfg) is not None:
            if cfg.add_bias_linear:
                raise UnsupportedModelError(
                    "--window-size exports as MistralForCausalLM (sliding_window), which has no biases: it needs "
                    "--disable-bias-linear (or --add-qkv-bias with it: Qwen2ForCausalLM)")
            return MISTRAL
        return LLAMA
    gpt2_missing = [k for k, ok in gpt2_needs.items() if not ok]
    llama_missing = [k for k, ok in llama_needs.items() if not ok]
    raise UnsupportedModelError(
        "this model has no exact Hugging Face equivalent: GPT2LMHeadModel needs "
        + "; ".join(gpt2_missing) + ". LlamaForCausalLM needs "
        + "; ".join(llama_missing) + " (so do Mistral, Qwen2 and Qwen3)."
    )


def exports_as(cfg: GPTConfig, architecture: str) -> bool:
    """Whether ``cfg`` can also be written as ``architecture`` (the class it was imported from) instead of
    :func:`hf_architecture`'s choice: a LLaMA-style model without biases is exactly a Mistral one."""
    try:
        chosen = hf_architecture(cfg)
    except UnsupportedModelError:
        return False
    return architecture == chosen or (architecture == MISTRAL and chosen == LLAMA and not cfg.add_bias_linear
                                      and not cfg.use_rope_scaling)


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------
def hf_config_dict(cfg: GPTConfig, architecture: str, *, vocab_size: int, dtype: str,
                   bos_token_id: int | None, eos_token_id: int | None, pad_token_id: int | None = None
                   ) -> dict[str, Any]:
    """The ``config.json`` content for ``cfg`` exported as ``architecture`` with ``vocab_size`` rows."""
    common: dict[str, Any] = {
        "architectures": [architecture],
        "vocab_size": vocab_size,
        "initializer_range": cfg.init_method_std,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if architecture == DEEPSEEK_V3:
        return deepseek_config_dict(cfg, common)
    if architecture == GPT2:
        return {
            **common,
            "model_type": "gpt2",
            "n_layer": cfg.num_layers,
            "n_embd": cfg.hidden_size,
            "n_head": cfg.num_attention_heads,
            "n_inner": cfg.ffn_hidden_size,
            "n_positions": cfg.max_position_embeddings,
            "n_ctx": cfg.max_position_embeddings,
            "activation_function": _HF_GELU[cfg.gelu_approximation],
            "layer_norm_epsilon": cfg.norm_epsilon,
            "resid_pdrop": cfg.hidden_dropout,
            "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }
    if architecture in _LLAMA_LIKE:
        llama_like = {
            **common,
            "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_query_groups,
            "head_dim": cfg.kv_channels,
            "intermediate_size": cfg.ffn_hidden_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_epsilon,
            **_hf_rope_entries(cfg),
            "attention_dropout": cfg.attention_dropout,
        }
        window = _sliding_window(cfg)
        # Qwen: layers from max_window_layers on slide; megatrain's --window-size is every layer's
        qwen_window = {"use_sliding_window": window is not None, "sliding_window": window,
                       "max_window_layers": 0 if window is not None else cfg.num_layers,
                       "layer_types": ["sliding_attention" if window is not None else "full_attention"]
                       * cfg.num_layers}
        if architecture == LLAMA:
            return {**llama_like, "model_type": "llama", "attention_bias": cfg.add_bias_linear,
                    "mlp_bias": cfg.add_bias_linear, "pretraining_tp": 1}
        if architecture == MISTRAL:
            return {**llama_like, "model_type": "mistral", "sliding_window": window}
        if architecture in (QWEN2, QWEN2_MOE):  # no head_dim field in the config; the attention reads one if present
            if cfg.kv_channels * cfg.num_attention_heads == cfg.hidden_size:
                del llama_like["head_dim"]
        if architecture in MOE_ARCHITECTURES:
            return {**llama_like, **moe_config_entries(cfg, architecture, window)}
        if architecture == QWEN2:
            return {**llama_like, **qwen_window, "model_type": "qwen2"}
        return {**llama_like, **qwen_window, "model_type": "qwen3", "attention_bias": False}
    raise UnsupportedModelError(f"unknown architecture {architecture!r}")


def _architecture_of(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if not archs and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise UnsupportedModelError(
        f"architecture {archs or model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor")  # transformers needs each of them


def _rope_of_hf(hf: Mapping[str, Any], arch: str, default_theta: float = 10000.0) -> dict[str, Any]:
    """The RoPE fields of GPTConfig (rotary_base, Llama 3.x scaling) from a LLaMA-like config.json.

    transformers reads ``rope_scaling`` when it is given (transformers 4's key, which 5 still takes)
    and otherwise ``rope_parameters`` (what transformers 5 writes); ``rope_theta`` inside it, else at
    the top level. Llama 3.x scaling (``rope_type: "llama3"``) is LlamaForCausalLM's; every other
    scaling type is refused, in either key."""
    sources = {key: hf.get(key) or {} for key in ("rope_scaling", "rope_parameters")}
    for key, source in sources.items():
        if not isinstance(source, Mapping):
            raise UnsupportedModelError(f"config.json field {key}: expected an object, got {source!r}")
        kind = source.get("rope_type", source.get("type", "default"))
        if kind not in (None, "default", "llama3"):
            raise UnsupportedModelError(
                f"config.json field {key}: rope scaling {kind!r} is not implemented in megatrain (llama3 is); "
                "refusing to convert (the model would behave differently on long contexts)")
        if source.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError(f"config.json field {key}: partial rotary embeddings "
                                        "(partial_rotary_factor != 1) are not supported")
    key = "rope_scaling" if sources["rope_scaling"] else "rope_parameters"
    source = sources[key]
    fields: dict[str, Any] = {"rotary_base": float(source.get("rope_theta", hf.get("rope_theta", default_theta)))}
    if source.get("rope_type", source.get("type", "default")) != "llama3":
        return fields
    if arch != LLAMA:
        raise UnsupportedModelError(f"config.json field {key}: rope scaling 'llama3' is supported for {LLAMA} "
                                    f"only, not {arch}")
    missing = [name for name in _LLAMA3_FIELDS if source.get(name) is None]
    if missing:
        raise UnsupportedModelError(f"config.json field {key}: rope scaling 'llama3' needs {', '.join(missing)} "
                                    "(transformers cannot build the model without them)")
    values = {name: source[name] for name in _LLAMA3_FIELDS}
    # transformers' default for the original context: the model's max_position_embeddings
    context = source.get("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    for name, value in {**values, "original_max_position_embeddings": context}.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UnsupportedModelError(f"config.json field {key}: {name} must be a number, got {value!r}")
    if context != int(context):
        raise UnsupportedModelError(f"config.json field {key}: original_max_position_embeddings must be an "
                                    f"integer, got {context!r}")
    return {**fields, "use_rope_scaling": True, "rope_scaling_factor": float(values["factor"]),
            "rope_scaling_low_freq_factor": float(values["low_freq_factor"]),
            "rope_scaling_high_freq_factor": float(values["high_freq_factor"]),
            "rope_scaling_original_max_position_embeddings": int(context)}


def _hf_rope_entries(cfg: GPTConfig) -> dict[str, Any]:
    """config.json's RoPE entries: ``rope_theta`` and ``rope_scaling`` (what transformers 4 reads and
    Meta's Llama 3.x files carry; transformers 5 reads them too) and, with Llama 3.x scaling,
    ``rope_parameters`` as transformers 5 writes it (the same values, ``rope_theta`` inside)."""
    if not cfg.use_rope_scaling:
        return {"rope_theta": cfg.rotary_base, "rope_scaling": None}
    scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
               "low_freq_factor": cfg.rope_scaling_low_freq_factor,
               "high_freq_factor": cfg.rope_scaling_high_freq_factor,
               "original_max_position_embeddings": cfg.rope_scaling_original_max_position_embeddings}
    return {"rope_theta": cfg.rotary_base, "rope_scaling": scaling,
            "rope_parameters": {**scaling, "rope_theta": cfg.rotary_base}}


def rope_scaling_flags(cfg: Any) -> list[str]:
    """The training flags of ``cfg``'s Llama 3.x RoPE scaling (none without it); the megatrain ones
    only where they differ from Megatron-LM's fixed values."""
    if not getattr(cfg, "use_rope_scaling", False):
        return []
    flags = ["--use-rope-scaling", "--rope-scaling-factor", repr(cfg.rope_scaling_factor)]
    megatron_values = (("low_freq_factor", 1.0), ("high_freq_factor", 4.0), ("original_max_position_embeddings", 8192))
    for name, megatron in megatron_values:
        value = getattr(cfg, "rope_scaling_" + name)
        if value != megatron:
            flags += ["--rope-scaling-" + name.replace("_", "-"), repr(value)]
    return flags


def _pretrain_flags(cfg: Any) -> list[str]:
    """The GPT family's flags beyond the shared transformer shape: RoPE scaling, then MoE."""
    return rope_scaling_flags(cfg) + moe_pretrain_flags(cfg) + deepseek_pretrain_flags(cfg)


# Hugging Face's names of the two GELUs (the tanh approximation has three, all the same function).
_GELU_OF_HF = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}
_HF_GELU = {"none": "gelu", "tanh": "gelu_new"}


def gpt_config_from_hf(hf: Mapping[str, Any], vocab_size: int) -> tuple[GPTConfig, str]:
    """GPTConfig (with the padded ``vocab_size``) and the architecture of a Hugging Face config dict."""
    arch = _architecture_of(hf)
    if arch == DEEPSEEK_V3:
        return deepseek_config_from_hf(hf, vocab_size, GPTConfig), arch
    # a missing tie_word_embeddings means the class's default: True for GPT-2, False for the others
    tied = bool(hf.get("tie_word_embeddings", arch == GPT2))
    if arch == GPT2:
        act = hf.get("activation_function", "gelu_new")
        if act not in _GELU_OF_HF:
            raise UnsupportedModelError(
                f"activation_function {act!r}: megatrain's GPT-2 style MLP computes exact GELU (\"gelu\") or its "
                "tanh approximation (\"gelu_new\", \"gelu_pytorch_tanh\", \"gelu_fast\")")
        for key, bad in (("scale_attn_by_inverse_layer_idx", True), ("scale_attn_weights", False),
                         ("add_cross_attention", True)):
            if hf.get(key, not bad) == bad:
                raise UnsupportedModelError(f"GPT-2 option {key}={bad} is not supported by megatrain")
        hidden = int(hf["n_embd"])
        cfg = GPTConfig(
            num_layers=int(hf["n_layer"]), hidden_size=hidden, num_attention_heads=int(hf["n_head"]),
            vocab_size=vocab_size, max_position_embeddings=int(hf.get("n_positions", 1024)),
            ffn_hidden_size=int(hf.get("n_inner") or 4 * hidden), position_embedding_type="learned_absolute",
            normalization="LayerNorm", norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)), swiglu=False,
            gelu_approximation=_GELU_OF_HF[act], add_bias_linear=True, untie_embeddings_and_output_weights=not tied,
            hidden_dropout=float(hf.get("resid_pdrop", 0.1)), attention_dropout=float(hf.get("attn_pdrop", 0.1)),
            init_method_std=float(hf.get("initializer_range", 0.02)))
        return cfg, arch
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r}: megatrain's SwiGLU uses silu only")
    # a MoE class has the attention of its dense twin (Mixtral: Mistral's, Qwen2/3-MoE: Qwen2/3's)
    moe_arch, arch = (arch, DENSE_TWIN[arch]) if arch in MOE_ARCHITECTURES else (None, arch)
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    max_positions = int(hf.get("max_position_embeddings", 2048))
    add_bias_linear, add_qkv_bias, qk_layernorm = attention_bias, False, False
    if arch == LLAMA:
        if attention_bias != mlp_bias:
            raise UnsupportedModelError(
                f"attention_bias={attention_bias} with mlp_bias={mlp_bias}: megatrain has one switch for all linear "
                "biases (--disable-bias-linear), so both must be equal")
    else:
        for key in ("mlp_bias", "attention_bias") if arch != QWEN3 else ("mlp_bias",):
            if hf.get(key):
                raise UnsupportedModelError(f"config.json field {key}: true is not part of {moe_arch or arch}; "
                                            "refusing it")
    window_size = (_window_size_of_hf(hf, arch) if moe_arch is None
                   else moe_window_size(hf, moe_arch, _window_size_of_hf))
    if arch == QWEN2:  # q/k/v have a bias, o_proj and the MLP none (Qwen2-MoE: if qkv_bias, its default)
        add_bias_linear, add_qkv_bias = False, True if moe_arch is None else bool(hf.get("qkv_bias", True))
    if arch == QWEN3:
        if attention_bias:
            raise UnsupportedModelError(
                "config.json field attention_bias: true: Qwen3 then has q/k/v/o biases but no MLP bias, which "
                "megatrain's one switch (--disable-bias-linear) cannot express")
        add_bias_linear, qk_layernorm = False, True
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    # Qwen3Config's default head_dim: 128 (Qwen3MoeConfig has none: hidden / heads)
    head_dim = hf.get("head_dim") or (128 if arch == QWEN3 and moe_arch is None else hidden // heads)
    layers = int(hf["num_hidden_layers"])
    moe_fields = moe_fields_from_hf(hf, moe_arch, layers) if moe_arch is not None else {}
    defaults = CLASS_DEFAULTS.get(moe_arch or "", {})
    cfg = GPTConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        vocab_size=vocab_size, max_position_embeddings=max_positions,
        ffn_hidden_size=int(hf["intermediate_size"]), kv_channels=int(head_dim),
        num_query_groups=int(hf.get("num_key_value_heads") or heads), position_embedding_type="rope",
        **_rope_of_hf(hf, arch if moe_arch is None else moe_arch, defaults.get("rope_theta", 10000.0)),
        normalization="RMSNorm",
        norm_epsilon=float(hf.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6))),
        swiglu=True, add_bias_linear=add_bias_linear, add_qkv_bias=add_qkv_bias, qk_layernorm=qk_layernorm,
        window_size=window_size,
        untie_embeddings_and_output_weights=not tied,
        hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_method_std=float(hf.get("initializer_range", 0.02)), **moe_fields)
    return cfg, moe_arch or arch


def _window_size_of_hf(hf: Mapping[str, Any], arch: str) -> tuple[int, int] | None:
    """--window-size of a Mistral / Qwen2 / Qwen3 config: sliding_window W (a query sees W keys, itself
    included) is (W - 1, 0); Qwen's per-layer choice must be the same for every layer."""
    window = hf.get("sliding_window")
    if arch in (QWEN2, QWEN3):
        if not hf.get("use_sliding_window"):
            window = None  # transformers' rule: no layer slides, whatever layer_types says
        types = hf.get("layer_types")
        if types is None:  # transformers' rule: layers from max_window_layers on slide
            start = int(hf.get("max_window_layers", 28))
            types = ["sliding_attention" if window is not None and i >= start else "full_attention"
                     for i in range(int(hf["num_hidden_layers"]))]
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise UnsupportedModelError(f"config.json field layer_types holds {unknown}: megatrain has full and "
                                        "sliding-window causal attention only")
        if window is not None and len(set(types)) > 1:
            raise UnsupportedModelError(
                "config.json field layer_types (or max_window_layers) mixes full and sliding-window layers: "
                "megatrain's --window-size applies to every layer (Megatron's --window-attn-skip-freq is not "
                "implemented)")
        if not types or types[0] == "full_attention":
            window = None
    elif arch != MISTRAL:
        return None
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(f"config.json field sliding_window: expected a positive integer, got {window!r}")
    return (window - 1, 0)


# ---------------------------------------------------------------------------------------------
# state dicts
# ---------------------------------------------------------------------------------------------
def _halves_order(head_dim: int) -> torch.Tensor:
    """Dims of a head in the order that turns ``--rotary-interleaved`` pairs (2i, 2i + 1) into Hugging
    Face's half-layout pairs (i, i + d/2): the even dims, then the odd ones."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def _to_half_layout(t: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """Query or key rows (weight [heads * d, h], bias [heads * d] or a norm weight [d]) of an interleaved
    RoPE model reordered within each head, so that half-layout RoPE computes the same attention scores."""
    if not cfg.rotary_interleaved:
        return t
    d = cfg.kv_channels
    assert d is not None
    return t.reshape(-1, d, *t.shape[1:])[:, _halves_order(d)].reshape(t.shape)


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: GPTConfig, architecture: str,
                     vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Our state dict (canonical names, full tensors) -> Hugging Face names and layouts.

    ``vocab_size`` trims (or zero-pads) the embedding and output rows. Tied output weights are not
    written (``tie_word_embeddings`` restores them). Biases we lack are written as zeros for GPT-2.
    """
    vocab_size = vocab_size or cfg.vocab_size
    if architecture == DEEPSEEK_V3:
        return deepseek_to_hf_state_dict(sd, cfg, vocab_size)
    if cfg.apply_layernorm_1p:  # Hugging Face stores the scale itself
        sd = {k: v + 1 if k.endswith("layernorm.weight") else v for k, v in sd.items()}
    out: dict[str, torch.Tensor] = {}
    h = cfg.hidden_size
    tied = not cfg.untie_embeddings_and_output_weights
    word = fit_rows(sd["embedding.word_embeddings.weight"], vocab_size)

    def bias(name: str, width: int) -> torch.Tensor:
        return sd[name] if name in sd else torch.zeros(width, dtype=word.dtype)

    if architecture == GPT2:
        out["transformer.wte.weight"] = word
        out["transformer.wpe.weight"] = sd["embedding.position_embeddings.weight"]
        for i in range(cfg.num_layers):
            p, q = f"layers.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                out[q + theirs + ".weight"] = sd[p + ours + ".weight"]
                out[q + theirs + ".bias"] = sd[p + ours + ".bias"]
            wq, wk, wv = qkv_split(sd[p + "self_attention.linear_qkv.weight"], cfg)
            out[q + "attn.c_attn.weight"] = torch.cat([wq, wk, wv]).t()
            bq, bk, bv = qkv_split(bias(p + "self_attention.linear_qkv.bias", 3 * h), cfg)
            out[q + "attn.c_attn.bias"] = torch.cat([bq, bk, bv])
            out[q + "attn.c_proj.weight"] = sd[p + "self_attention.linear_proj.weight"].t()
            out[q + "attn.c_proj.bias"] = bias(p + "self_attention.linear_proj.bias", h)
            out[q + "mlp.c_fc.weight"] = sd[p + "mlp.linear_fc1.weight"].t()
            out[q + "mlp.c_fc.bias"] = bias(p + "mlp.linear_fc1.bias", cfg.ffn_hidden_size)
            out[q + "mlp.c_proj.weight"] = sd[p + "mlp.linear_fc2.weight"].t()
            out[q + "mlp.c_proj.bias"] = bias(p + "mlp.linear_fc2.bias", h)
        out["transformer.ln_f.weight"] = sd["final_layernorm.weight"]
        out["transformer.ln_f.bias"] = sd["final_layernorm.bias"]
        if not tied:
            out["lm_head.weight"] = fit_rows(sd["output_layer.weight"], vocab_size)
    elif architecture in _LLAMA_LIKE:
        moe = moe_layers(cfg)
        out["model.embed_tokens.weight"] = word
        for i in range(cfg.num_layers):
            p, q = f"layers.{i}.", f"model.layers.{i}."
            out[q + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
            out[q + "post_attention_layernorm.weight"] = sd[p + "pre_mlp_layernorm.weight"]
            wq, wk, wv = qkv_split(sd[p + "self_attention.linear_qkv.weight"], cfg)
            wq, wk = _to_half_layout(wq, cfg), _to_half_layout(wk, cfg)  # --rotary-interleaved
            out[q + "self_attn.q_proj.weight"], out[q + "self_attn.k_proj.weight"] = wq, wk
            out[q + "self_attn.v_proj.weight"] = wv
            out[q + "self_attn.o_proj.weight"] = sd[p + "self_attention.linear_proj.weight"]
            if moe[i]:
                out.update(moe_mlp_to_hf(sd, cfg, architecture, i))
            else:
                fc1 = sd[p + "mlp.linear_fc1.weight"]
                out[q + "mlp.gate_proj.weight"], out[q + "mlp.up_proj.weight"] = fc1[0::2], fc1[1::2]
                out[q + "mlp.down_proj.weight"] = sd[p + "mlp.linear_fc2.weight"]
            if cfg.qk_layernorm:
                out[q + "self_attn.q_norm.weight"] = _to_half_layout(sd[p + "self_attention.q_layernorm.weight"], cfg)
                out[q + "self_attn.k_norm.weight"] = _to_half_layout(sd[p + "self_attention.k_layernorm.weight"], cfg)
            if cfg.add_bias_linear or cfg.add_qkv_bias:
                bq, bk, bv = qkv_split(sd[p + "self_attention.linear_qkv.bias"], cfg)
                bq, bk = _to_half_layout(bq, cfg), _to_half_layout(bk, cfg)
                out[q + "self_attn.q_proj.bias"], out[q + "self_attn.k_proj.bias"] = bq, bk
                out[q + "self_attn.v_proj.bias"] = bv
            if cfg.add_bias_linear:
                out[q + "self_attn.o_proj.bias"] = sd[p + "self_attention.linear_proj.bias"]
                b1 = sd[p + "mlp.linear_fc1.bias"]
                out[q + "mlp.gate_proj.bias"], out[q + "mlp.up_proj.bias"] = b1[0::2], b1[1::2]
                out[q + "mlp.down_proj.bias"] = sd[p + "mlp.linear_fc2.bias"]
        out["model.norm.weight"] = sd["final_layernorm.weight"]
        if not tied:
            out["lm_head.weight"] = fit_rows(sd["output_layer.weight"], vocab_size)
    else:
        raise UnsupportedModelError(f"unknown architecture {architecture!r}")
    return out  # views of ``sd`` where the layout allows: the writer copies them shard by shard


# Hugging Face keys that hold no parameters (old GPT-2 files store attention mask buffers).
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def from_hf_state_dict(hf: Mapping[str, torch.Tensor], cfg: GPTConfig, architecture: str) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> our canonical state dict for ``cfg`` (vocabulary zero-padded to cfg's size).

    Raises UnsupportedModelError on missing or unexpected tensors, so nothing is silently dropped.
    """
    if architecture == DEEPSEEK_V3:
        return deepseek_from_hf_state_dict(hf, cfg)
    hf = {k: v for k, v in hf.items() if not k.endswith(_IGNORED_SUFFIXES)}
    tensors = HFTensors(hf, strip=("transformer.", "model."))
    take, has = tensors.take, tensors.has

    tied = not cfg.untie_embeddings_and_output_weights
    h, vocab = cfg.hidden_size, cfg.vocab_size
    sd: dict[str, torch.Tensor] = {}
    if architecture == GPT2:
        sd["embedding.word_embeddings.weight"] = fit_rows(take("transformer.wte.weight"), vocab)
        sd["embedding.position_embeddings.weight"] = take("transformer.wpe.weight")
        for i in range(cfg.num_layers):
            p, q = f"layers.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                sd[p + ours + ".weight"] = take(q + theirs + ".weight")
                sd[p + ours + ".bias"] = take(q + theirs + ".bias")
            wq, wk, wv = take(q + "attn.c_attn.weight").t().split(h)
            sd[p + "self_attention.linear_qkv.weight"] = qkv_join(wq, wk, wv, cfg)
            bq, bk, bv = take(q + "attn.c_attn.bias").split(h)
            sd[p + "self_attention.linear_qkv.bias"] = qkv_join(bq, bk, bv, cfg)
            sd[p + "self_attention.linear_proj.weight"] = take(q + "attn.c_proj.weight").t()
            sd[p + "self_attention.linear_proj.bias"] = take(q + "attn.c_proj.bias")
            sd[p + "mlp.linear_fc1.weight"] = take(q + "mlp.c_fc.weight").t()
            sd[p + "mlp.linear_fc1.bias"] = take(q + "mlp.c_fc.bias")
            sd[p + "mlp.linear_fc2.weight"] = take(q + "mlp.c_proj.weight").t()
            sd[p + "mlp.linear_fc2.bias"] = take(q + "mlp.c_proj.bias")
        sd["final_layernorm.weight"] = take("transformer.ln_f.weight")
        sd["final_layernorm.bias"] = take("transformer.ln_f.bias")
    elif architecture in _LLAMA_LIKE:
        moe = moe_layers(cfg)
        sd["embedding.word_embeddings.weight"] = fit_rows(take("model.embed_tokens.weight"), vocab)
        for i in range(cfg.num_layers):
            p, q = f"layers.{i}.", f"model.layers.{i}."
            sd[p + "input_layernorm.weight"] = take(q + "input_layernorm.weight")
            sd[p + "pre_mlp_layernorm.weight"] = take(q + "post_attention_layernorm.weight")
            sd[p + "self_attention.linear_qkv.weight"] = qkv_join(
                take(q + "self_attn.q_proj.weight"), take(q + "self_attn.k_proj.weight"),
                take(q + "self_attn.v_proj.weight"), cfg)
            sd[p + "self_attention.linear_proj.weight"] = take(q + "self_attn.o_proj.weight")
            if moe[i]:
                sd.update(moe_mlp_from_hf(take, has, cfg, architecture, i))
            else:
                gate, up = take(q + "mlp.gate_proj.weight"), take(q + "mlp.up_proj.weight")
                sd[p + "mlp.linear_fc1.weight"] = torch.stack([gate, up], dim=1).reshape(-1, h)
                sd[p + "mlp.linear_fc2.weight"] = take(q + "mlp.down_proj.weight")
            if cfg.qk_layernorm:
                sd[p + "self_attention.q_layernorm.weight"] = take(q + "self_attn.q_norm.weight")
                sd[p + "self_attention.k_layernorm.weight"] = take(q + "self_attn.k_norm.weight")
            if cfg.add_bias_linear or cfg.add_qkv_bias:
                sd[p + "self_attention.linear_qkv.bias"] = qkv_join(
                    take(q + "self_attn.q_proj.bias"), take(q + "self_attn.k_proj.bias"),
                    take(q + "self_attn.v_proj.bias"), cfg)
            if cfg.add_bias_linear:
                sd[p + "self_attention.linear_proj.bias"] = take(q + "self_attn.o_proj.bias")
                sd[p + "mlp.linear_fc1.bias"] = torch.stack(
                    [take(q + "mlp.gate_proj.bias"), take(q + "mlp.up_proj.bias")], dim=1).reshape(-1)
                sd[p + "mlp.linear_fc2.bias"] = take(q + "mlp.down_proj.bias")
        sd["final_layernorm.weight"] = take("model.norm.weight")
    else:
        raise UnsupportedModelError(f"unknown architecture {architecture!r}")
    if not tied:
        sd["output_layer.weight"] = fit_rows(take("lm_head.weight"), vocab)
    else:
        tensors.mark("lm_head.weight")  # a tied copy written out by some savers
    tensors.refuse_leftovers()
    return {k: v.contiguous() for k, v in sd.items()}


def _accepts(hf: Mapping[str, Any]) -> bool:
    try:
        _architecture_of(hf)
    except UnsupportedModelError:
        return False
    return True


ADAPTER = HFAdapter(architectures=SUPPORTED_ARCHITECTURES, accepts=_accepts, architecture=hf_architecture,
                    config_dict=hf_config_dict, exports_as=exports_as, to_hf_state_dict=to_hf_state_dict, config_from_hf=gpt_config_from_hf,
                    from_hf_state_dict=from_hf_state_dict, family_flags=_pretrain_flags)
