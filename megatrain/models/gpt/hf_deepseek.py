"""The DeepSeek-V3 part of the GPT family's Hugging Face mapping: ``DeepseekV3ForCausalLM`` <-> a GPTModel
with multi-latent attention (``--multi-latent-attention``, :mod:`megatrain.models.common.mla`) and,
optionally, DeepSeek's mixture of experts. :mod:`megatrain.models.gpt.hf` dispatches here.

Pure tensor and dict code (``transformers`` is not imported).

Attention (per layer, ``model.layers.i.self_attn.`` -> ``layers.i.self_attention.``): ``q_proj`` ->
``linear_q_proj`` (``q_lora_rank: null``) or ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` ->
``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj``; ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` /
``kv_b_proj`` -> ``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj``; ``o_proj`` ->
``linear_proj``. The same layouts (``rope_interleave: true`` is what megatrain's MLA RoPE computes), no
reorders. Hugging Face always has the latent norms: ``--qk-layernorm``. Its latent norms use eps 1e-6
whatever ``rms_norm_eps`` is, ours ``--norm-epsilon``: both must be 1e-6.

RoPE: ``rope_type: "yarn"`` is ``--rope-type yarn`` (factor, original_max_position_embeddings, beta_fast,
beta_slow, mscale, mscale_all_dim as ``--rotary-scaling-factor`` & co.); ``default`` is ``--rope-type
rope``. transformers' cos/sin scale is mscale(f, mscale) / mscale(f, mscale_all_dim) only when both are
non-zero, else mscale(f, 1); Megatron's is always the ratio: settings where the two differ are refused.

MoE (layers from ``first_k_dense_replace`` on; ``--moe-layer-freq`` ``[0]*k + [1]*rest``): sigmoid scores
(``--moe-router-score-function sigmoid``), the choice biased by ``e_score_correction_bias``
(``--moe-router-enable-expert-bias``'s ``router.expert_bias``; zeros without it), group-limited routing
(``n_group`` / ``topk_group``; transformers ranks a group by its top-2 scores, Megatron by its top
topk / group_topk: they agree when that is 2, or with no group limit: n_group = topk_group), the top-k
renormalised (``norm_topk_prob``), times ``routed_scaling_factor`` (``--moe-router-topk-scaling-factor``),
plus ``n_shared_experts`` ungated shared experts of ``moe_intermediate_size`` each
(``--moe-shared-expert-intermediate-size`` = their sum). Experts are written per expert
(``mlp.experts.j.gate_proj`` ...) as transformers saves them; the fused in-memory layout imports too.

Multi-token-prediction layers (``num_nextn_predict_layers``) are not built by transformers; a folder
holding their weights (``model.layers.N.*`` for N >= num_hidden_layers) is refused, and an export leaves
a megatrain model's depths (``--mtp-num-layers``) out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, Iterator

import torch

from megatrain.models.common.hf_adapter import ConfigFields, HFTensors, UnsupportedModelError, fit_rows
from megatrain.models.gpt.hf_moe import is_moe, moe_layers, moe_mlp_from_hf, moe_mlp_to_hf

__all__ = ["DEEPSEEK_V3", "deepseek_architecture", "deepseek_config_dict", "deepseek_config_from_hf",
           "deepseek_to_hf_state_dict", "deepseek_from_hf_state_dict", "deepseek_pretrain_flags"]

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
_LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which q_a_layernorm / kv_a_layernorm keep

# DeepseekV3Config's defaults for fields a config.json may leave out
DEFAULTS: dict[str, Any] = {
    "hidden_size": 7168, "num_attention_heads": 128, "num_hidden_layers": 61,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "intermediate_size": 18432, "rope_interleave": True,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
}


def _mscale(factor: float, m: float | None) -> float:
    """YaRN's 0.1 * m * ln(factor) + 1 (1 for factor <= 1), as transformers' and Megatron's."""
    return 1.0 if factor <= 1 else 0.1 * (m or 0.0) * math.log(factor) + 1.0


def _hf_yarn_scales(factor: float, mscale: float | None, mscale_all_dim: float | None) -> tuple[float, float]:
    """transformers' (cos/sin attention_factor, softmax-scale multiplier) of a yarn config."""
    attention = (_mscale(factor, mscale) / _mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                 else _mscale(factor, 1.0))
    softmax = _mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return attention, softmax


def _ours_yarn_scales(factor: float, mscale: float, mscale_all_dim: float) -> tuple[float, float]:
    """Megatron's (and megatrain's) same two numbers."""
    return _mscale(factor, mscale) / _mscale(factor, mscale_all_dim), _mscale(factor, mscale_all_dim) ** 2


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


def _first_dense(cfg: Any) -> int:
    """first_k_dense_replace of ``cfg``'s MoE-layer pattern; UnsupportedModelError when it is not
    k dense layers followed by MoE layers only."""
    pattern = moe_layers(cfg)
    k = next((i for i, moe in enumerate(pattern) if moe), len(pattern))
    if not all(pattern[k:]):
        raise UnsupportedModelError(
            f"--moe-layer-freq {cfg.moe_layer_freq}: DeepseekV3ForCausalLM's MoE layers are all those from "
            "first_k_dense_replace on, so only [0]*k + [1]*rest patterns (dense layers first) export")
    return k


# ---------------------------------------------------------------------------------------------
# export: the checks, and config.json
# ---------------------------------------------------------------------------------------------
def deepseek_architecture(cfg: Any) -> str:
    """DEEPSEEK_V3 for a multi-latent-attention ``cfg`` that class computes exactly; else
    UnsupportedModelError naming what is missing."""
    needs = {
        "--qk-layernorm (its kv_a_layernorm / q_a_layernorm always exist)": cfg.qk_layernorm,
        "RMSNorm (--normalization RMSNorm)": cfg.normalization == "RMSNorm",
        "a SwiGLU MLP (--swiglu)": cfg.swiglu,
        "no linear biases (--disable-bias-linear)": not cfg.add_bias_linear and not cfg.add_qkv_bias,
        "no --apply-layernorm-1p": not cfg.apply_layernorm_1p,
        "full causal attention (no --window-size)": cfg.window_size is None or cfg.window_size[0] < 0,
        "no learned position table (--position-embedding-type rope)": cfg.position_embedding_type == "rope",
        f"--norm-epsilon {_LATENT_NORM_EPS} (its latent norms' eps is fixed)": cfg.norm_epsilon == _LATENT_NORM_EPS,
    }
    missing = [k for k, ok in needs.items() if not ok]
    if missing:
        raise UnsupportedModelError("--multi-latent-attention exports as DeepseekV3ForCausalLM, which needs "
                                    + "; ".join(missing))
    _rope_entries(cfg)  # raises for RoPE settings it cannot express
    if is_moe(cfg):
        _moe_entries(cfg)
    return DEEPSEEK_V3


def _rope_entries(cfg: Any) -> dict[str, Any]:
    f = float(cfg.rotary_scaling_factor)
    if cfg.rope_type == "rope":
        if _mscale(f, cfg.mscale_all_dim) != 1.0:
            raise UnsupportedModelError(
                f"--rope-type rope with --rotary-scaling-factor {f} and --mscale-all-dim {cfg.mscale_all_dim}: "
                "Megatron scales the softmax by mscale(factor, mscale_all_dim)^2 even without YaRN, "
                "DeepseekV3ForCausalLM's default RoPE never does")
        return {"rope_theta": cfg.rotary_base, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base}}
    ours = _ours_yarn_scales(f, cfg.mscale, cfg.mscale_all_dim)
    theirs = _hf_yarn_scales(f, cfg.mscale, cfg.mscale_all_dim)
    if not (_close(ours[0], theirs[0]) and _close(ours[1], theirs[1])):
        raise UnsupportedModelError(
            f"--mscale {cfg.mscale} with --mscale-all-dim {cfg.mscale_all_dim}: transformers' YaRN scales cos/sin "
            "by mscale(factor, mscale) / mscale(factor, mscale_all_dim) only when both are non-zero (else "
            "mscale(factor, 1)), Megatron always by the ratio; these values give different models")
    yarn = {"rope_type": "yarn", "factor": f,
            "original_max_position_embeddings": int(cfg.yarn_original_max_position_embeddings),
            "beta_fast": float(cfg.yarn_beta_fast), "beta_slow": float(cfg.yarn_beta_slow),
            "mscale": float(cfg.mscale), "mscale_all_dim": float(cfg.mscale_all_dim)}
    return {"rope_theta": cfg.rotary_base, "rope_scaling": dict(yarn),
            "rope_parameters": {**yarn, "rope_theta": cfg.rotary_base}}


def _moe_entries(cfg: Any) -> dict[str, Any]:
    needs = {
        "sigmoid routing (--moe-router-score-function sigmoid)": cfg.moe_router_score_function == "sigmoid",
        "no --moe-shared-expert-gate (its shared experts are ungated)": not cfg.moe_shared_expert_gate,
        "shared experts (--moe-shared-expert-intermediate-size)": bool(cfg.moe_shared_expert_intermediate_size),
        "dropless experts (no --moe-expert-capacity-factor)": cfg.moe_expert_capacity_factor is None,
        "learned routing (no --moe-router-force-load-balancing)":
            not getattr(cfg, "moe_router_force_load_balancing", False),
        "at least 2 experts (it ranks experts in pairs)": cfg.num_moe_experts >= 2,
    }
    missing = [k for k, ok in needs.items() if not ok]
    if missing:
        raise UnsupportedModelError("a mixture-of-experts model with --multi-latent-attention exports as "
                                    "DeepseekV3ForCausalLM, which needs " + "; ".join(missing))
    f, shared = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size, cfg.moe_shared_expert_intermediate_size
    if shared % f:
        raise UnsupportedModelError(
            f"--moe-shared-expert-intermediate-size {shared}: DeepseekV3ForCausalLM's shared experts are "
            f"n_shared_experts x moe_intermediate_size, a multiple of --moe-ffn-hidden-size ({f})")
    k, e = cfg.moe_router_topk, cfg.num_moe_experts
    groups, group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
    if not group_topk or group_topk == groups:  # every group is chosen: no limit
        n_group, topk_group = 1, 1
    elif k // group_topk != 2:
        raise UnsupportedModelError(
            f"--moe-router-group-topk {group_topk} with --moe-router-topk {k}: Megatron ranks a group by the sum "
            f"of its top topk / group_topk = {k // group_topk} scores, DeepseekV3ForCausalLM by its top 2")
    else:
        n_group, topk_group = groups, group_topk
    scaling = cfg.moe_router_topk_scaling_factor
    return {"n_routed_experts": e, "num_experts_per_tok": k, "moe_intermediate_size": f,
            "n_shared_experts": shared // f, "n_group": n_group, "topk_group": topk_group,
            "norm_topk_prob": k > 1,  # Megatron renormalises sigmoid top-k scores whenever k > 1
            "routed_scaling_factor": float(scaling) if scaling else 1.0, "first_k_dense_replace": _first_dense(cfg),
            "scoring_func": "sigmoid", "topk_method": "noaux_tc"}  # what DeepSeek's own code and vLLM read


def deepseek_config_dict(cfg: Any, common: Mapping[str, Any]) -> dict[str, Any]:
    """config.json of ``cfg`` exported as DeepseekV3ForCausalLM (``common``: the entries every class has)."""
    deepseek_architecture(cfg)
    moe = _moe_entries(cfg) if is_moe(cfg) else {"first_k_dense_replace": cfg.num_layers}  # dense: no MoE layer
    return {
        **common, "model_type": "deepseek_v3",
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.ffn_hidden_size, "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_epsilon, "attention_bias": False,
        "attention_dropout": cfg.attention_dropout,
        "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_head_dim,
        "qk_rope_head_dim": cfg.qk_pos_emb_head_dim, "v_head_dim": cfg.v_head_dim, "rope_interleave": True,
        **_rope_entries(cfg), **moe, "num_nextn_predict_layers": 0, "output_router_logits": False,
    }


# ---------------------------------------------------------------------------------------------
# import: config fields
# ---------------------------------------------------------------------------------------------
def _positive_int(fields: ConfigFields, key: str) -> int:
    value = fields.number(key, int)
    if value <= 0:
        raise UnsupportedModelError(f"config.json field {key}: expected a positive integer, got {value}")
    return value


def _rope_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """GPTConfig's MLA RoPE fields of a DeepseekV3 config.json (``rope_scaling`` when given, as
    transformers reads it, else ``rope_parameters``; ``rope_theta`` inside, else at the top level)."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    source = hf.get(key) or {}
    if not isinstance(source, Mapping):
        raise UnsupportedModelError(f"config.json field {key}: expected an object, got {source!r}")
    kind = source.get("rope_type", source.get("type", "default"))
    theta = source.get("rope_theta", hf.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise UnsupportedModelError(f"config.json field rope_theta: expected a positive number, got {theta!r}")
    if source.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"config.json field {key}: partial_rotary_factor != 1 is not supported")
    if kind == "default":
        return {"rotary_base": float(theta), "rope_type": "rope"}
    if kind != "yarn":
        raise UnsupportedModelError(f"config.json field {key}: rope type {kind!r}: megatrain's multi-latent attention "
                                    "has default RoPE (--rope-type rope) and YaRN (--rope-type yarn) only")
    if source.get("truncate", True) is not True:
        raise UnsupportedModelError(f"config.json field {key}: truncate false (YaRN's ramp not rounded to whole "
                                    "pairs) is not what Megatron's YaRN computes")
    original = hf.get("original_max_position_embeddings",  # transformers' priority, then its default
                      source.get("original_max_position_embeddings", hf.get("max_position_embeddings", 4096)))
    factor = source.get("factor")
    if factor is None:  # transformers' rule
        factor = hf.get("max_position_embeddings", 4096) / original
    values = {"factor": factor, "original_max_position_embeddings": original,
              "beta_fast": source.get("beta_fast") or 32.0, "beta_slow": source.get("beta_slow") or 1.0,
              "mscale": source.get("mscale") or 0.0, "mscale_all_dim": source.get("mscale_all_dim") or 0.0}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UnsupportedModelError(f"config.json field {key}: {name} must be a number, got {value!r}")
    if original != int(original) or original <= 0:
        raise UnsupportedModelError(f"config.json field {key}: original_max_position_embeddings must be a positive "
                                    f"integer, got {original!r}")
    f, ms, msad = float(factor), float(values["mscale"]), float(values["mscale_all_dim"])
    attention, softmax = _hf_yarn_scales(f, ms, msad)
    # Megatron's mscale giving transformers' cos/sin scale: theirs when both are set; 1 when mscale_all_dim is 0
    ours_mscale = ms if ms and msad else 1.0
    if attention_factor := source.get("attention_factor"):
        if not _close(float(attention_factor), attention):
            raise UnsupportedModelError(f"config.json field {key}: attention_factor {attention_factor} (instead of the "
                                        "one YaRN derives from factor and mscale) has no megatrain flag")
    if not all(_close(a, b) for a, b in zip(_ours_yarn_scales(f, ours_mscale, msad), (attention, softmax))):
        raise UnsupportedModelError(
            f"config.json field {key}: mscale {source.get('mscale')!r} with mscale_all_dim {msad}: transformers "
            "then scales cos/sin by mscale(factor, 1), which Megatron's --mscale / --mscale-all-dim cannot express")
    return {"rotary_base": float(theta), "rope_type": "yarn", "rotary_scaling_factor": f, "mscale": ours_mscale,
            "mscale_all_dim": msad, "yarn_original_max_position_embeddings": int(original),
            "yarn_beta_fast": float(values["beta_fast"]), "yarn_beta_slow": float(values["beta_slow"])}


def _moe_fields(fields: ConfigFields, num_layers: int) -> dict[str, Any]:
    first_dense = fields.number("first_k_dense_replace", int)
    if first_dense >= num_layers:
        return {}
    if first_dense < 0:
        raise UnsupportedModelError(f"config.json field first_k_dense_replace: {first_dense} is negative")
    experts, topk = _positive_int(fields, "n_routed_experts"), _positive_int(fields, "num_experts_per_tok")
    if not 2 <= experts or topk > experts:
        raise UnsupportedModelError(f"config.json field num_experts_per_tok: {topk} of {experts} experts (n_routed_"
                                    "experts) is not a routing megatrain computes as transformers does")
    norm = fields.get("norm_topk_prob")
    if norm is not (topk > 1):
        raise UnsupportedModelError(
            f"config.json field norm_topk_prob: {norm!r} with num_experts_per_tok {topk}: Megatron renormalises "
            "sigmoid top-k scores exactly when top-k > 1")
    scoring = fields.hf.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise UnsupportedModelError(f"config.json field scoring_func: {scoring!r}; DeepSeek-V3 routing is sigmoid")
    method = fields.hf.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise UnsupportedModelError(f"config.json field topk_method: {method!r}; transformers' DeepseekV3 routes "
                                    "as noaux_tc (bias-corrected group-limited top-k)")
    n_group, topk_group = _positive_int(fields, "n_group"), _positive_int(fields, "topk_group")
    if experts % n_group or topk_group > n_group or experts // n_group < 2:
        raise UnsupportedModelError(f"config.json fields n_group {n_group} / topk_group {topk_group}: need n_group "
                                    f"to divide the {experts} experts into groups of at least 2, topk_group <= n_group")
    groups: dict[str, Any] = {}
    if topk_group != n_group:
        if topk % topk_group or topk // topk_group != 2:
            raise UnsupportedModelError(
                f"config.json fields topk_group {topk_group} with num_experts_per_tok {topk}: transformers ranks a "
                "group by its top-2 scores, Megatron by its top topk / group_topk: they agree only when that is 2")
        groups = {"moe_router_num_groups": n_group, "moe_router_group_topk": topk_group}
    shared = fields.number("n_shared_experts", int)
    if shared <= 0:
        raise UnsupportedModelError(f"config.json field n_shared_experts: {shared}; megatrain's shared experts need a "
                                    "positive size")
    scaling = fields.number("routed_scaling_factor", float)
    if scaling <= 0:
        raise UnsupportedModelError(f"config.json field routed_scaling_factor: {scaling} must be positive")
    width = _positive_int(fields, "moe_intermediate_size")
    return {"num_moe_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": width,
            "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_topk_scaling_factor": None if scaling == 1.0 else scaling,
            "moe_shared_expert_intermediate_size": shared * width,
            "moe_layer_freq": 1 if first_dense == 0 else [0] * first_dense + [1] * (num_layers - first_dense),
            # config.json says nothing of training: DeepSeek-V3's own recipe (the sequence-wise balance loss, 1e-4)
            "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-4, **groups}


def deepseek_config_from_hf(hf: Mapping[str, Any], vocab_size: int, config_class: type) -> Any:
    """GPTConfig (``config_class``) of a DeepseekV3 config.json; UnsupportedModelError naming the field."""
    fields = ConfigFields(hf, DEFAULTS)
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("rope_interleave", True)):
        if fields.get(key) != want:
            raise UnsupportedModelError(f"config.json field {key}: {fields.get(key)!r} is not supported (only {want!r} "
                                        "is what megatrain's multi-latent attention computes)")
    eps = fields.number("rms_norm_eps", float)
    if eps != _LATENT_NORM_EPS:
        raise UnsupportedModelError(f"config.json field rms_norm_eps: {eps}; transformers' DeepseekV3 latent norms use "
                                    f"{_LATENT_NORM_EPS} whatever it says, megatrain's --norm-epsilon for every norm")
    heads = _positive_int(fields, "num_attention_heads")
    if hf.get("num_key_value_heads") not in (None, heads):
        raise UnsupportedModelError(f"config.json field num_key_value_heads: {hf['num_key_value_heads']} != the "
                                    f"{heads} heads; multi-latent attention has a key and value per head")
    layers = _positive_int(fields, "num_hidden_layers")
    q_rank = hf.get("q_lora_rank", DEFAULTS["q_lora_rank"])
    if q_rank is not None:
        q_rank = _positive_int(fields, "q_lora_rank")
    return config_class(
        num_layers=layers, hidden_size=_positive_int(fields, "hidden_size"), num_attention_heads=heads,
        vocab_size=vocab_size, max_position_embeddings=_positive_int(fields, "max_position_embeddings"),
        ffn_hidden_size=_positive_int(fields, "intermediate_size"), position_embedding_type="rope",
        multi_latent_attention=True, q_lora_rank=q_rank, kv_lora_rank=_positive_int(fields, "kv_lora_rank"),
        qk_head_dim=_positive_int(fields, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=_positive_int(fields, "qk_rope_head_dim"),
        v_head_dim=_positive_int(fields, "v_head_dim"), qk_layernorm=True, **_rope_fields(hf),
        normalization="RMSNorm", norm_epsilon=eps, swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=not bool(fields.get("tie_word_embeddings")),
        hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout") or 0.0),
        init_method_std=float(hf.get("initializer_range", 0.02)), **_moe_fields(fields, layers))


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------
_ATTENTION = (("linear_q_proj", "q_proj"), ("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"),
              ("linear_q_up_proj", "q_b_proj"), ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
              ("kv_layernorm", "kv_a_layernorm"), ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj"))
_SHARED = ("gate_proj", "up_proj", "down_proj")


def _attention_names(cfg: Any) -> list[tuple[str, str]]:
    q = {"linear_q_proj"} if cfg.q_lora_rank is None else {"linear_q_down_proj", "q_layernorm", "linear_q_up_proj"}
    return [(ours, theirs) for ours, theirs in _ATTENTION if ours in q or not ours.startswith(("linear_q", "q_"))]


def _routed_only(cfg: Any) -> SimpleNamespace:
    """What hf_moe's expert mapping reads of ``cfg``, without the (Qwen-named) shared expert."""
    return SimpleNamespace(num_moe_experts=cfg.num_moe_experts, hidden_size=cfg.hidden_size,
                           moe_ffn_hidden_size=cfg.moe_ffn_hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
                           moe_shared_expert_intermediate_size=None)


def deepseek_to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: Any, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our canonical state dict -> DeepseekV3ForCausalLM's tensors (views where the layout allows)."""
    word = fit_rows(sd["embedding.word_embeddings.weight"], vocab_size)
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": word}
    moe = moe_layers(cfg)
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[q + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[q + "post_attention_layernorm.weight"] = sd[p + "pre_mlp_layernorm.weight"]
        for ours, theirs in _attention_names(cfg):
            out[q + f"self_attn.{theirs}.weight"] = sd[p + f"self_attention.{ours}.weight"]
        if moe[i]:
            out.update(_moe_to_hf(sd, cfg, i))
        else:
            fc1 = sd[p + "mlp.linear_fc1.weight"]
            out[q + "mlp.gate_proj.weight"], out[q + "mlp.up_proj.weight"] = fc1[0::2], fc1[1::2]
            out[q + "mlp.down_proj.weight"] = sd[p + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = sd["final_layernorm.weight"]
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = fit_rows(sd["output_layer.weight"], vocab_size)
    return out


def _moe_to_hf(sd: Mapping[str, torch.Tensor], cfg: Any, i: int) -> Iterator[tuple[str, torch.Tensor]]:
    p, q = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
    yield from moe_mlp_to_hf(sd, _routed_only(cfg), "DeepseekV3", i)
    bias = sd.get(p + "router.expert_bias")
    yield q + "gate.e_score_correction_bias", (bias if bias is not None
                                               else torch.zeros(cfg.num_moe_experts, dtype=torch.float32))
    s1 = sd[p + "shared_experts.linear_fc1.weight"]
    yield q + "shared_experts.gate_proj.weight", s1[0::2]
    yield q + "shared_experts.up_proj.weight", s1[1::2]
    yield q + "shared_experts.down_proj.weight", sd[p + "shared_experts.linear_fc2.weight"]


def deepseek_from_hf_state_dict(hf: Mapping[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """DeepseekV3ForCausalLM's tensors -> our canonical state dict; UnsupportedModelError on missing or
    unexpected tensors (multi-token-prediction layers included), so nothing is silently dropped."""
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    mtp = sorted(k for k in hf if k.startswith("model.layers.")
                 and k.split(".")[2].isdigit() and int(k.split(".")[2]) >= cfg.num_layers)
    if mtp:
        raise UnsupportedModelError(
            f"the Hugging Face weights hold multi-token-prediction layers (e.g. {mtp[0]!r}; num_nextn_predict_layers): "
            "transformers drops them and megatrain does not convert them (it trains its own: --mtp-num-layers); "
            "remove them from the folder to convert the rest")
    tensors = HFTensors(hf)
    take, has = tensors.take, tensors.has

    h, vocab = cfg.hidden_size, cfg.vocab_size
    sd: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": fit_rows(take("model.embed_tokens.weight"), vocab)}
    moe = moe_layers(cfg)
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = take(q + "input_layernorm.weight")
        sd[p + "pre_mlp_layernorm.weight"] = take(q + "post_attention_layernorm.weight")
        for ours, theirs in _attention_names(cfg):
            sd[p + f"self_attention.{ours}.weight"] = take(q + f"self_attn.{theirs}.weight")
        if moe[i]:
            sd.update(moe_mlp_from_hf(take, has, _routed_only(cfg), "DeepseekV3", i))
            sd[p + "mlp.router.expert_bias"] = take(q + "mlp.gate.e_score_correction_bias").float()
            g, u, d = (take(q + f"mlp.shared_experts.{n}.weight") for n in _SHARED)
            sd[p + "mlp.shared_experts.linear_fc1.weight"] = torch.stack([g, u], dim=1).reshape(-1, h)
            sd[p + "mlp.shared_experts.linear_fc2.weight"] = d
        else:
            gate, up = take(q + "mlp.gate_proj.weight"), take(q + "mlp.up_proj.weight")
            sd[p + "mlp.linear_fc1.weight"] = torch.stack([gate, up], dim=1).reshape(-1, h)
            sd[p + "mlp.linear_fc2.weight"] = take(q + "mlp.down_proj.weight")
    sd["final_layernorm.weight"] = take("model.norm.weight")
    if cfg.untie_embeddings_and_output_weights:
        sd["output_layer.weight"] = fit_rows(take("lm_head.weight"), vocab)
    else:
        tensors.mark("lm_head.weight")  # a tied copy written out by some savers
    tensors.refuse_leftovers()
    return {k: v.contiguous() for k, v in sd.items()}


# ---------------------------------------------------------------------------------------------
# the training flags that rebuild an imported model (beyond hf_moe's and the shared ones)
# ---------------------------------------------------------------------------------------------
def deepseek_pretrain_flags(cfg: Any) -> list[str]:
    """``pretrain_gpt.py`` routing flags of a DeepSeek-style MoE ``cfg`` (none for other models)."""
    if not is_moe(cfg):
        return []
    flags: list[str] = []
    if cfg.moe_router_score_function != "softmax":
        flags += ["--moe-router-score-function", cfg.moe_router_score_function]
    if cfg.moe_router_enable_expert_bias:
        flags += ["--moe-router-enable-expert-bias"]
    if cfg.moe_router_topk_scaling_factor is not None:
        flags += ["--moe-router-topk-scaling-factor", repr(cfg.moe_router_topk_scaling_factor)]
    if cfg.moe_router_num_groups is not None:
        flags += ["--moe-router-num-groups", str(cfg.moe_router_num_groups)]
    if cfg.moe_router_group_topk is not None:
        flags += ["--moe-router-group-topk", str(cfg.moe_router_group_topk)]
    return flags
