"""The mixture-of-experts part of the GPT family's Hugging Face mapping: ``MixtralForCausalLM``,
``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM`` (their attention, norms and rotary are those of
Mistral, Qwen2 and Qwen3, which :mod:`megatrain.models.gpt.hf` maps; this module owns the MoE
config fields, the choice of class on export, and the weights of the MoE layers).

Pure tensor and dict code (``transformers`` is not imported).

How the classes route, in Megatron's terms:

- every class: softmax over all experts, then the ``num_experts_per_tok`` largest
  (``--moe-router-topk``); no expert bias, no groups, no scaling, never a dropped token.
- Mixtral renormalises the top-k probabilities: Megatron's default (top-k of the logits, then a
  softmax over those k), the same numbers. Qwen2-MoE and Qwen3-MoE renormalise only with
  ``norm_topk_prob: true``; with false (their default) the top-k probabilities are used as they
  are, which is ``--moe-router-pre-softmax``.
- Qwen2-MoE adds a shared expert (``shared_expert_intermediate_size``,
  ``--moe-shared-expert-intermediate-size``) whose output is scaled by sigmoid(x . w)
  (``shared_expert_gate``, ``--moe-shared-expert-gate``).
- which layers are MoE: Mixtral every layer; Qwen layer i unless ``i in mlp_only_layers`` or
  ``(i + 1) % decoder_sparse_step != 0`` (a dense layer has ``intermediate_size``, experts
  ``moe_intermediate_size``): ``--moe-layer-freq`` 1 or the 0/1 list.
- ``router_aux_loss_coef`` is ``--moe-aux-loss-coeff`` (``--moe-router-load-balancing-type
  aux_loss``): the coefficient carries over; Megatron adds one balancing loss per MoE layer, while
  transformers computes one over all layers' routing (and only with ``output_router_logits``).

Weights. Ours per MoE layer ``layers.i.mlp.``: ``router.weight`` [E, h]; ``experts.linear_fc1.weight``
[E, 2F, h] with gate/up rows interleaved per channel (as the dense MLP); ``experts.linear_fc2.weight``
[E, h, F]; ``shared_experts.linear_fc1/linear_fc2.weight`` and ``shared_experts.gate_weight`` [1, h].
Hugging Face's files hold one tensor per expert (``block_sparse_moe.experts.j.w1/w3/w2`` for Mixtral,
``mlp.experts.j.gate_proj/up_proj/down_proj`` for Qwen), which is what transformers 5 writes (it fuses
them into ``mlp.experts.gate_up_proj`` [E, 2F, h] (gate rows, then up rows) and ``down_proj`` in
memory); export writes that per-expert layout, import reads it or the fused one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from megatrain.models.common.hf_adapter import ConfigFields, UnsupportedModelError

__all__ = ["MIXTRAL", "QWEN2_MOE", "QWEN3_MOE", "MOE_ARCHITECTURES", "MOE_MODEL_TYPES", "DENSE_TWIN", "CLASS_DEFAULTS",
           "is_moe", "moe_layers", "moe_architecture", "moe_config_entries", "moe_fields_from_hf", "moe_window_size",
           "moe_mlp_to_hf", "moe_mlp_from_hf", "moe_pretrain_flags"]

MIXTRAL = "MixtralForCausalLM"
QWEN2_MOE = "Qwen2MoeForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
MOE_ARCHITECTURES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)
MOE_MODEL_TYPES = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE}
# The dense class whose attention, norms and rotary embeddings each one has.
DENSE_TWIN = {MIXTRAL: "MistralForCausalLM", QWEN2_MOE: "Qwen2ForCausalLM", QWEN3_MOE: "Qwen3ForCausalLM"}

# transformers' defaults for the fields a config.json may leave out (MixtralConfig, Qwen2MoeConfig,
# Qwen3MoeConfig).
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    MIXTRAL: {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
              "router_jitter_noise": 0.0, "rms_norm_eps": 1e-5, "rope_theta": 1e6},
    QWEN2_MOE: {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "norm_topk_prob": False,
                "router_aux_loss_coef": 0.001, "mlp_only_layers": [], "qkv_bias": True, "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0},
    QWEN3_MOE: {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
                "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0},
}


def is_moe(cfg: Any) -> bool:
    return getattr(cfg, "num_moe_experts", None) is not None


def moe_layers(cfg: Any) -> list[bool]:
    """Whether each layer (0-based) is a MoE layer (``--moe-layer-freq``: int N, every N-th from layer 0;
    or the 0/1 list)."""
    if not is_moe(cfg):
        return [False] * cfg.num_layers
    if hasattr(cfg, "is_moe_layer"):
        return [bool(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)]
    freq = cfg.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(cfg.num_layers)]
    return [bool(v) for v in freq]


def _moe_ffn(cfg: Any) -> int:
    return cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size


def _aux_coefficient(cfg: Any) -> float:
    """router_aux_loss_coef: the coefficient of --moe-router-load-balancing-type aux_loss (with several
    types, that one's, else global_aux_loss's, else seq_aux_loss's)."""
    if not hasattr(cfg, "aux_loss_coeff"):
        return float(cfg.moe_aux_loss_coeff)
    for kind in ("aux_loss", "global_aux_loss", "seq_aux_loss"):
        if cfg.aux_loss_coeff(kind):
            return cfg.aux_loss_coeff(kind)
    return 0.0


# ---------------------------------------------------------------------------------------------
# export: which class, and its config entries
# ---------------------------------------------------------------------------------------------
def moe_architecture(cfg: Any) -> str:
    """The Hugging Face MoE class of a LLaMA-style ``cfg`` with ``--num-experts``; UnsupportedModelError
    (naming the flags) when none of the three computes what it computes."""
    needs = {
        "no linear biases (--disable-bias-linear; --add-qkv-bias is allowed for Qwen2-MoE)": not cfg.add_bias_linear,
        "softmax routing (--moe-router-score-function softmax)": cfg.moe_router_score_function == "softmax",
        "no --moe-router-topk-scaling-factor": cfg.moe_router_topk_scaling_factor in (None, 1.0),
        "no group-limited routing (--moe-router-num-groups, --moe-router-group-topk)":
            not cfg.moe_router_num_groups and not cfg.moe_router_group_topk,
        "no --moe-router-enable-expert-bias (it changes which experts are chosen)":
            not cfg.moe_router_enable_expert_bias,
        "dropless experts (no --moe-expert-capacity-factor: these classes never drop tokens)":
            cfg.moe_expert_capacity_factor is None,
        "learned routing (no --moe-router-force-load-balancing)":
            not getattr(cfg, "moe_router_force_load_balancing", False),
    }
    missing = [k for k, ok in needs.items() if not ok]
    if missing:
        raise UnsupportedModelError("this mixture-of-experts model has no exact Hugging Face equivalent: "
                                    "MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM need "
                                    + "; ".join(missing))
    if cfg.moe_shared_expert_intermediate_size:
        if not cfg.moe_shared_expert_gate:
            raise UnsupportedModelError(
                "--moe-shared-expert-intermediate-size exports as Qwen2MoeForCausalLM, whose shared expert is always "
                "gated by sigmoid(x . w): it needs --moe-shared-expert-gate")
        if cfg.qk_layernorm:
            raise UnsupportedModelError(
                "shared experts with --qk-layernorm: Qwen2MoeForCausalLM (shared experts) has no q/k norms and "
                "Qwen3MoeForCausalLM (q/k norms) no shared expert")
        return QWEN2_MOE
    if cfg.qk_layernorm:
        if cfg.add_qkv_bias:
            raise UnsupportedModelError("--qk-layernorm exports as Qwen3MoeForCausalLM, which needs "
                                        "--disable-bias-linear without --add-qkv-bias")
        return QWEN3_MOE
    mixtral_needs = {
        "top-k probabilities renormalised (no --moe-router-pre-softmax)": not cfg.moe_router_pre_softmax,
        "every layer MoE (--moe-layer-freq 1)": all(moe_layers(cfg)),
        "no --add-qkv-bias": not cfg.add_qkv_bias,
    }
    missing = [k for k, ok in mixtral_needs.items() if not ok]
    if missing:
        raise UnsupportedModelError(
            "a MoE model without shared experts or --qk-layernorm exports as MixtralForCausalLM, which needs "
            + "; ".join(missing) + " (Qwen2MoeForCausalLM needs a gated shared expert, Qwen3MoeForCausalLM "
            "--qk-layernorm)")
    return MIXTRAL


def _sparse_layout(pattern: list[bool]) -> tuple[int, list[int]]:
    """Qwen's (decoder_sparse_step, mlp_only_layers) for a MoE-layer pattern: a step when one gives it."""
    if all(pattern):
        return 1, []
    for step in range(2, len(pattern) + 1):
        if all(moe == ((i + 1) % step == 0) for i, moe in enumerate(pattern)):
            return step, []
    return 1, [i for i, moe in enumerate(pattern) if not moe]


def moe_config_entries(cfg: Any, architecture: str, window: int | None) -> dict[str, Any]:
    """config.json entries of the MoE class beyond the attention's (``window``: Hugging Face's sliding_window)."""
    common = {"num_experts_per_tok": cfg.moe_router_topk, "router_aux_loss_coef": _aux_coefficient(cfg),
              "output_router_logits": False}
    if architecture == MIXTRAL:
        # router_jitter_noise 0: transformers' jitter multiplies the experts' input too, Megatron's
        # --moe-input-jitter-eps the router's only; both act in training alone
        return {**common, "model_type": "mixtral", "num_local_experts": cfg.num_moe_experts,
                "intermediate_size": _moe_ffn(cfg), "router_jitter_noise": 0.0, "sliding_window": window}
    step, dense_layers = _sparse_layout(moe_layers(cfg))
    qwen = {**common, "num_experts": cfg.num_moe_experts, "moe_intermediate_size": _moe_ffn(cfg),
            "intermediate_size": cfg.ffn_hidden_size, "norm_topk_prob": not cfg.moe_router_pre_softmax,
            "decoder_sparse_step": step, "mlp_only_layers": dense_layers,
            "use_sliding_window": window is not None, "sliding_window": window}
    if architecture == QWEN2_MOE:
        return {**qwen, "model_type": "qwen2_moe", "qkv_bias": cfg.add_qkv_bias,
                "shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
                "max_window_layers": cfg.num_layers,
                "layer_types": ["sliding_attention" if window is not None else "full_attention"] * cfg.num_layers}
    return {**qwen, "model_type": "qwen3_moe", "attention_bias": False}


# ---------------------------------------------------------------------------------------------
# import: config fields
# ---------------------------------------------------------------------------------------------
def _expert_count(hf: Mapping[str, Any], arch: str) -> int:
    """num_local_experts (Mixtral; Qwen3-MoE's name in transformers 5) or num_experts (Qwen's)."""
    keys = ("num_experts",) if arch == QWEN2_MOE else ("num_local_experts", "num_experts")
    given = {k: hf[k] for k in keys if hf.get(k) is not None}
    if len({repr(v) for v in given.values()}) > 1:
        raise UnsupportedModelError(f"config.json fields {' and '.join(given)} disagree ({given}); refusing to guess")
    default_key = "num_local_experts" if arch == MIXTRAL else "num_experts"
    return ConfigFields(hf, CLASS_DEFAULTS[arch]).number(next(iter(given), default_key), int)


def moe_fields_from_hf(hf: Mapping[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """The TransformerConfig MoE fields of a MoE class's config.json (Mixtral's ``intermediate_size`` is
    its experts' and, unused, ``--ffn-hidden-size``); UnsupportedModelError naming the field otherwise."""
    fields = ConfigFields(hf, CLASS_DEFAULTS[arch])
    experts = _expert_count(hf, arch)
    topk = fields.number("num_experts_per_tok", int)
    if experts < 1:
        raise UnsupportedModelError(f"config.json: {experts} experts; a model without experts is a dense one")
    if not 1 <= topk <= experts:
        raise UnsupportedModelError(f"config.json field num_experts_per_tok: {topk} is not between 1 and the "
                                    f"{experts} experts")
    renormalised = arch == MIXTRAL or fields.get("norm_topk_prob") is True
    if topk == 1 and renormalised:
        raise UnsupportedModelError(
            "config.json field num_experts_per_tok: 1 with renormalised top-k probabilities"
            + (" (norm_topk_prob: true)" if arch != MIXTRAL else "") + " weighs every token's expert by 1, so the "
            "router gets no gradient: Megatron refuses --moe-router-topk 1 without --moe-router-pre-softmax")
    out: dict[str, Any] = {"num_moe_experts": experts, "moe_router_topk": topk,
                           "moe_aux_loss_coeff": fields.number("router_aux_loss_coef", float),
                           "moe_router_load_balancing_type": "aux_loss"}
    if arch == MIXTRAL:
        if fields.number("router_jitter_noise", float) != 0.0:
            raise UnsupportedModelError(
                "config.json field router_jitter_noise: transformers' Mixtral jitters the experts' input as well as "
                "the router's, Megatron's --moe-input-jitter-eps the router's only; refusing (set it to 0.0 to "
                "convert: it acts in training only)")
        return {**out, "moe_ffn_hidden_size": fields.number("intermediate_size", int), "moe_router_pre_softmax": False,
                "moe_layer_freq": 1}
    norm_topk = fields.get("norm_topk_prob")
    if not isinstance(norm_topk, bool):
        raise UnsupportedModelError(f"config.json field norm_topk_prob: expected true or false, got {norm_topk!r}")
    step = fields.number("decoder_sparse_step", int)
    if step < 1:
        raise UnsupportedModelError(f"config.json field decoder_sparse_step: expected a positive integer, got {step}")
    dense = fields.get("mlp_only_layers")
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise UnsupportedModelError(f"config.json field mlp_only_layers: expected a list of layer numbers, "
                                    f"got {dense!r}")
    pattern = [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
    if not any(pattern):
        raise UnsupportedModelError("config.json fields mlp_only_layers / decoder_sparse_step leave no MoE layer; "
                                    "refusing (the model is a dense one)")
    out.update(moe_ffn_hidden_size=fields.number("moe_intermediate_size", int), moe_router_pre_softmax=not norm_topk,
               moe_layer_freq=1 if all(pattern) else [int(p) for p in pattern])
    if arch == QWEN2_MOE:
        shared = fields.number("shared_expert_intermediate_size", int)
        if shared <= 0:
            raise UnsupportedModelError(
                f"config.json field shared_expert_intermediate_size: {shared}; megatrain's shared experts need a "
                "positive size (refusing a zero-width shared expert with a gate)")
        out.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return out


def moe_window_size(hf: Mapping[str, Any], arch: str,
                    dense_rule: Callable[[Mapping[str, Any], str], tuple[int, int] | None]) -> tuple[int, int] | None:
    """--window-size of a MoE class: Qwen3-MoE slides every layer by ``sliding_window`` when
    ``use_sliding_window``; the others follow their dense twin's rule (``dense_rule``), Qwen2-MoE only
    with explicit ``layer_types`` (its default layout of sliding layers differs between transformers
    versions)."""
    if arch == QWEN3_MOE:
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        if window is None:
            return None
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise UnsupportedModelError(f"config.json field sliding_window: expected a positive integer, "
                                        f"got {window!r}")
        return (window - 1, 0)
    if arch == QWEN2_MOE and hf.get("use_sliding_window") and hf.get("layer_types") is None:
        raise UnsupportedModelError(
            "config.json field use_sliding_window: true without layer_types: which layers of a Qwen2-MoE slide "
            "differs between transformers versions; refusing (list them in layer_types)")
    return dense_rule(hf, DENSE_TWIN[arch])


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------
_EXPERT_NAMES = {MIXTRAL: ("w1", "w3", "w2")}  # gate, up, down
_QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def _hf_prefix(arch: str, i: int) -> str:
    return f"model.layers.{i}." + ("block_sparse_moe." if arch == MIXTRAL else "mlp.")


def moe_mlp_to_hf(sd: Mapping[str, torch.Tensor], cfg: Any, arch: str, i: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face tensors of MoE layer ``i`` (views of ours: the writer copies them shard by shard)."""
    p, q = f"layers.{i}.mlp.", _hf_prefix(arch, i)
    gate, up, down = _EXPERT_NAMES.get(arch, _QWEN_EXPERT_NAMES)
    yield q + "gate.weight", sd[p + "router.weight"]
    fc1, fc2 = sd[p + "experts.linear_fc1.weight"], sd[p + "experts.linear_fc2.weight"]
    for e in range(cfg.num_moe_experts):
        yield q + f"experts.{e}.{gate}.weight", fc1[e, 0::2]
        yield q + f"experts.{e}.{up}.weight", fc1[e, 1::2]
        yield q + f"experts.{e}.{down}.weight", fc2[e]
    if cfg.moe_shared_expert_intermediate_size:
        s1 = sd[p + "shared_experts.linear_fc1.weight"]
        yield q + "shared_expert.gate_proj.weight", s1[0::2]
        yield q + "shared_expert.up_proj.weight", s1[1::2]
        yield q + "shared_expert.down_proj.weight", sd[p + "shared_experts.linear_fc2.weight"]
        yield q + "shared_expert_gate.weight", sd[p + "shared_experts.gate_weight"]


def _shaped(t: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise UnsupportedModelError(f"the Hugging Face tensor {name!r} has shape {list(t.shape)}; the config "
                                    f"describes {list(shape)}")
    return t


def moe_mlp_from_hf(take: Callable[[str], torch.Tensor], has: Callable[[str], bool], cfg: Any, arch: str,
                    i: int) -> dict[str, torch.Tensor]:
    """Our tensors of MoE layer ``i`` from Hugging Face's (per-expert tensors, or transformers 5's fused
    ``experts.gate_up_proj`` / ``experts.down_proj``), each expert copied once into the stacked tensor."""
    p, q = f"layers.{i}.mlp.", _hf_prefix(arch, i)
    if arch == MIXTRAL and not has(q + "gate.weight") and has(f"model.layers.{i}.mlp.gate.weight"):
        q = f"model.layers.{i}.mlp."  # transformers 5's in-memory names
    n, h, f = cfg.num_moe_experts, cfg.hidden_size, _moe_ffn(cfg)
    out = {p + "router.weight": _shaped(take(q + "gate.weight"), (n, h), q + "gate.weight")}
    if has(q + "experts.gate_up_proj"):
        gate_up = _shaped(take(q + "experts.gate_up_proj"), (n, 2 * f, h), q + "experts.gate_up_proj")
        fc1 = torch.stack([gate_up[:, :f], gate_up[:, f:]], dim=2)
        fc2 = _shaped(take(q + "experts.down_proj"), (n, h, f), q + "experts.down_proj")
    else:
        gate, up, down = _EXPERT_NAMES.get(arch, _QWEN_EXPERT_NAMES)
        first = take(q + f"experts.0.{gate}.weight")
        fc1 = first.new_empty(n, f, 2, h)
        fc2 = first.new_empty(n, h, f)
        for e in range(n):
            for j, name in enumerate((gate, up)):
                key = q + f"experts.{e}.{name}.weight"
                fc1[e, :, j] = _shaped(take(key), (f, h), key)
            key = q + f"experts.{e}.{down}.weight"
            fc2[e] = _shaped(take(key), (h, f), key)
    out[p + "experts.linear_fc1.weight"] = fc1.reshape(n, 2 * f, h)
    out[p + "experts.linear_fc2.weight"] = fc2
    if cfg.moe_shared_expert_intermediate_size:
        s = cfg.moe_shared_expert_intermediate_size
        names = [q + f"shared_expert.{name}.weight" for name in _QWEN_EXPERT_NAMES]
        g, u = (_shaped(take(k), (s, h), k) for k in names[:2])
        out[p + "shared_experts.linear_fc1.weight"] = torch.stack([g, u], dim=1).reshape(2 * s, h)
        out[p + "shared_experts.linear_fc2.weight"] = _shaped(take(names[2]), (h, s), names[2])
        out[p + "shared_experts.gate_weight"] = _shaped(take(q + "shared_expert_gate.weight"), (1, h),
                                                         q + "shared_expert_gate.weight")
    return out


# ---------------------------------------------------------------------------------------------
# the training flags that rebuild an imported model
# ---------------------------------------------------------------------------------------------
def moe_pretrain_flags(cfg: Any) -> list[str]:
    """``pretrain_gpt.py`` MoE flags for ``cfg`` (none for a dense model)."""
    if not is_moe(cfg):
        return []
    flags = ["--num-experts", str(cfg.num_moe_experts), "--moe-router-topk", str(cfg.moe_router_topk),
             "--moe-ffn-hidden-size", str(_moe_ffn(cfg))]
    freq = cfg.moe_layer_freq
    if freq != 1:
        flags += ["--moe-layer-freq", str(freq) if isinstance(freq, int) else "[" + ",".join(map(str, freq)) + "]"]
    if cfg.moe_router_pre_softmax:
        flags += ["--moe-router-pre-softmax"]
    if cfg.moe_shared_expert_intermediate_size:
        flags += ["--moe-shared-expert-intermediate-size", str(cfg.moe_shared_expert_intermediate_size)]
    if cfg.moe_shared_expert_gate:
        flags += ["--moe-shared-expert-gate"]
    types, coeffs = cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff
    listed = isinstance(types, (list, tuple))
    flags += ["--moe-router-load-balancing-type", *(types if listed else [types]),
              "--moe-aux-loss-coeff", *map(repr, coeffs if listed else [coeffs])]
    return flags
