"""Mapping between the LLaVA family's vision encoder and Hugging Face's ``CLIPVisionModel`` (``model_type``
"clip_vision_model"), on its own or as LLaVA's ``vision_tower``.

Pure tensor and dict code (``transformers`` is not imported), as every family's adapter:

=========================================  ===============================================================
megatrain (VisionEncoder)                  Hugging Face (CLIPVisionModel; files before transformers 5
                                           put ``vision_model.`` first)
=========================================  ===============================================================
conv1.weight                               embeddings.patch_embedding.weight
class_token [1, 1, h]                      embeddings.class_embedding [h]
position_embeddings.weight                 embeddings.position_embedding.weight
ln_pre                                     pre_layrnorm
layers.N.input_layernorm                   encoder.layers.N.layer_norm1
layers.N.self_attention.linear_qkv         encoder.layers.N.self_attn.{q,k,v}_proj (grouped rows joined)
layers.N.self_attention.linear_proj        encoder.layers.N.self_attn.out_proj
layers.N.pre_mlp_layernorm                 encoder.layers.N.layer_norm2
layers.N.mlp.linear_fc1, linear_fc2        encoder.layers.N.mlp.fc1, fc2
ln_post (post_layernorm "pooled")          post_layernorm (its pooler output: the class token only)
=========================================  ===============================================================

Both compute softmax(q k^T / sqrt(d)) v; CLIP's ``hidden_act`` "quick_gelu" is our vision activation
"quick_gelu", "gelu" exact GELU, "gelu_new" / "gelu_pytorch_tanh" / "gelu_fast" its tanh
approximation. Anything CLIPVisionModel cannot express is refused with one line naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from megatrain.models.common.hf_adapter import ConfigFields, HFAdapter, UnsupportedModelError, qkv_join, qkv_split
from megatrain.models.llava.config import VisionConfig

__all__ = ["CLIP_VISION", "VISION_MODEL_TYPE", "CLIP_VISION_ADAPTER", "clip_vision_architecture",
           "clip_vision_config_dict", "vision_config_from_hf", "vision_to_hf_state_dict", "vision_from_hf_state_dict"]

CLIP_VISION = "CLIPVisionModel"
VISION_MODEL_TYPE = "clip_vision_model"

# CLIPVisionConfig's defaults, for keys a config.json leaves out
_HF_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
    "attention_dropout": 0.0, "initializer_range": 0.02,
}
# hidden_act -> (our vision activation, gelu_approximation)
_ACT_OF_HF = {"quick_gelu": ("quick_gelu", "none"), "gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"),
              "gelu_pytorch_tanh": ("gelu", "tanh"), "gelu_fast": ("gelu", "tanh")}
_IGNORED_SUFFIXES = ("embeddings.position_ids",)  # a buffer older files store


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------
def clip_vision_architecture(cfg: VisionConfig) -> str:
    """CLIPVisionModel; UnsupportedModelError naming every field it cannot express."""
    needs = {
        "a square image (img_h = img_w: CLIP's one image_size)": cfg.img_h == cfg.img_w,
        "the class token (add_class_token)": cfg.add_class_token,
        "linear biases (add_bias_linear)": cfg.add_bias_linear,
        "no grouped-query attention (num_query_groups = num_attention_heads)":
            cfg.num_query_groups == cfg.num_attention_heads,
        "head dim = hidden / heads (kv_channels)": cfg.kv_channels * cfg.num_attention_heads == cfg.hidden_size,
        "no qk_layernorm": not cfg.qk_layernorm,
        "full attention (no window_size)": cfg.window_size is None,
        "post_layernorm 'pooled' or 'none' (CLIP normalises its pooled class token only)":
            cfg.post_layernorm != "all",
    }
    missing = [k for k, ok in needs.items() if not ok]
    if missing:
        raise UnsupportedModelError(f"this vision encoder has no exact {CLIP_VISION} equivalent: it needs "
                                    + "; ".join(missing))
    return CLIP_VISION


def _hidden_act(cfg: VisionConfig) -> str:
    if cfg.activation == "quick_gelu":
        return "quick_gelu"
    return "gelu_pytorch_tanh" if cfg.gelu_approximation == "tanh" else "gelu"


def clip_vision_config_dict(cfg: VisionConfig, architecture: str = CLIP_VISION, *, dtype: str = "float32",
                            **_ids: Any) -> dict[str, Any]:
    """The ``config.json`` content (or LLaVA's ``vision_config``) for ``cfg``."""
    clip_vision_architecture(cfg)
    return {
        "architectures": [CLIP_VISION],
        "model_type": VISION_MODEL_TYPE,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_channels": cfg.num_channels,
        "image_size": cfg.img_h,
        "patch_size": cfg.patch_dim,
        "hidden_act": _hidden_act(cfg),
        "layer_norm_eps": cfg.norm_epsilon,
        "attention_dropout": cfg.attention_dropout,
        "initializer_range": cfg.init_method_std,
        "initializer_factor": 1.0,
        "torch_dtype": dtype,
    }


def vision_config_from_hf(hf: Mapping[str, Any], *, field: str = "", post_layernorm: str = "pooled") -> VisionConfig:
    """VisionConfig of a CLIPVisionConfig dict; ``field`` prefixes the field names in messages (LLaVA's
    "vision_config.")."""
    model_type = hf.get("model_type", VISION_MODEL_TYPE)
    if model_type != VISION_MODEL_TYPE:
        raise UnsupportedModelError(f"config.json field {field}model_type: {model_type!r} is not supported "
                                    f"(megatrain's vision encoder is CLIP's: {VISION_MODEL_TYPE!r})")
    fields = ConfigFields(hf, _HF_DEFAULTS)
    act = fields.get("hidden_act")
    if act not in _ACT_OF_HF:
        raise UnsupportedModelError(f"config.json field {field}hidden_act: {act!r} is not supported (quick_gelu, "
                                    "gelu, gelu_new, gelu_pytorch_tanh, gelu_fast)")
    activation, approximation = _ACT_OF_HF[act]
    numbers: dict[str, int] = {}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                "image_size", "patch_size"):
        value = fields.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise UnsupportedModelError(f"config.json field {field}{key}: expected one integer, got {value!r}")
        numbers[key] = value
    try:
        return VisionConfig(
            num_layers=numbers["num_hidden_layers"], hidden_size=numbers["hidden_size"],
            num_attention_heads=numbers["num_attention_heads"], ffn_hidden_size=numbers["intermediate_size"],
            num_channels=numbers["num_channels"], img_h=numbers["image_size"], img_w=numbers["image_size"],
            patch_dim=numbers["patch_size"], activation=activation, gelu_approximation=approximation,
            norm_epsilon=fields.number("layer_norm_eps", float),
            attention_dropout=fields.number("attention_dropout", float), hidden_dropout=0.0,
            init_method_std=fields.number("initializer_range", float), post_layernorm=post_layernorm)
    except ValueError as e:
        if isinstance(e, UnsupportedModelError):
            raise
        where = f"config.json field {field.rstrip('.')}" if field else "config.json"
        raise UnsupportedModelError(f"{where} describes no valid CLIP vision encoder: {e}") from None


# ---------------------------------------------------------------------------------------------
# state dicts
# ---------------------------------------------------------------------------------------------
def _layer_names(i: int) -> tuple[str, str]:
    return f"layers.{i}.", f"encoder.layers.{i}."


def vision_to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: VisionConfig) -> dict[str, torch.Tensor]:
    """Our encoder's state dict (names relative to it) -> CLIPVisionModel's names (transformers 5: no
    ``vision_model.`` prefix). Without ``ln_post`` (post_layernorm "none") the pooler's LayerNorm is
    written as the identity (weight 1, bias 0): LLaVA never reads it."""
    clip_vision_architecture(cfg)

    def norm(name: str) -> torch.Tensor:
        return sd[name] + 1 if cfg.apply_layernorm_1p else sd[name]

    h = cfg.hidden_size
    dtype = sd["conv1.weight"].dtype
    out: dict[str, torch.Tensor] = {
        "embeddings.class_embedding": sd["class_token"].reshape(h),
        "embeddings.patch_embedding.weight": sd["conv1.weight"],
        "embeddings.position_embedding.weight": sd["position_embeddings.weight"],
        "pre_layrnorm.weight": norm("ln_pre.weight"), "pre_layrnorm.bias": sd["ln_pre.bias"],
    }
    for i in range(cfg.num_layers):
        p, q = _layer_names(i)
        out[q + "layer_norm1.weight"] = norm(p + "input_layernorm.weight")
        out[q + "layer_norm1.bias"] = sd[p + "input_layernorm.bias"]
        for kind in ("weight", "bias"):
            wq, wk, wv = qkv_split(sd[p + f"self_attention.linear_qkv.{kind}"], cfg)
            out[q + f"self_attn.q_proj.{kind}"], out[q + f"self_attn.k_proj.{kind}"] = wq, wk
            out[q + f"self_attn.v_proj.{kind}"] = wv
            out[q + f"self_attn.out_proj.{kind}"] = sd[p + f"self_attention.linear_proj.{kind}"]
            out[q + f"mlp.fc1.{kind}"] = sd[p + f"mlp.linear_fc1.{kind}"]
            out[q + f"mlp.fc2.{kind}"] = sd[p + f"mlp.linear_fc2.{kind}"]
        out[q + "layer_norm2.weight"] = norm(p + "pre_mlp_layernorm.weight")
        out[q + "layer_norm2.bias"] = sd[p + "pre_mlp_layernorm.bias"]
    if "ln_post.weight" in sd:
        out["post_layernorm.weight"], out["post_layernorm.bias"] = norm("ln_post.weight"), sd["ln_post.bias"]
    else:
        out["post_layernorm.weight"] = torch.ones(h, dtype=dtype)
        out["post_layernorm.bias"] = torch.zeros(h, dtype=dtype)
    return {k: v.contiguous() for k, v in out.items()}


def vision_from_hf_state_dict(take: Callable[[str], torch.Tensor], cfg: VisionConfig) -> dict[str, torch.Tensor]:
    """CLIPVisionModel's tensors, each read by ``take(name)`` (names relative to the vision model, without
    ``vision_model.``) -> our encoder's state dict. ``take`` raises on a missing tensor."""
    sd: dict[str, torch.Tensor] = {
        "class_token": take("embeddings.class_embedding").reshape(1, 1, cfg.hidden_size),
        "conv1.weight": take("embeddings.patch_embedding.weight"),
        "position_embeddings.weight": take("embeddings.position_embedding.weight"),
        "ln_pre.weight": take("pre_layrnorm.weight"), "ln_pre.bias": take("pre_layrnorm.bias"),
    }
    for i in range(cfg.num_layers):
        p, q = _layer_names(i)
        sd[p + "input_layernorm.weight"] = take(q + "layer_norm1.weight")
        sd[p + "input_layernorm.bias"] = take(q + "layer_norm1.bias")
        for kind in ("weight", "bias"):
            sd[p + f"self_attention.linear_qkv.{kind}"] = qkv_join(
                take(q + f"self_attn.q_proj.{kind}"), take(q + f"self_attn.k_proj.{kind}"),
                take(q + f"self_attn.v_proj.{kind}"), cfg)
            sd[p + f"self_attention.linear_proj.{kind}"] = take(q + f"self_attn.out_proj.{kind}")
            sd[p + f"mlp.linear_fc1.{kind}"] = take(q + f"mlp.fc1.{kind}")
            sd[p + f"mlp.linear_fc2.{kind}"] = take(q + f"mlp.fc2.{kind}")
        sd[p + "pre_mlp_layernorm.weight"] = take(q + "layer_norm2.weight")
        sd[p + "pre_mlp_layernorm.bias"] = take(q + "layer_norm2.bias")
    weight, bias = take("post_layernorm.weight"), take("post_layernorm.bias")
    if cfg.post_layernorm != "none":
        sd["ln_post.weight"], sd["ln_post.bias"] = weight, bias
    return {k: v.contiguous() for k, v in sd.items()}


class TensorTaker:
    """Hands out a Hugging Face file's tensors by name and remembers which were used, so that tensors
    nothing took (which converting would drop) can be refused."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], ignored_suffixes: tuple[str, ...] = ()) -> None:
        self.tensors = {k: v for k, v in tensors.items() if not k.endswith(ignored_suffixes)}
        self.used: set[str] = set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise UnsupportedModelError(f"the Hugging Face weights have no tensor {name!r}")
        self.used.add(name)
        return self.tensors[name]

    def refuse_unused(self, what: str) -> None:
        unexpected = sorted(set(self.tensors) - self.used)
        if unexpected:
            raise UnsupportedModelError(f"the Hugging Face weights hold tensors {what} has no place for (e.g. "
                                        f"{unexpected[:3]}); the config does not describe them, so converting "
                                        "would drop them")


def _strip(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in tensors.items()}


# ---------------------------------------------------------------------------------------------
# the adapter of a CLIPVisionModel folder on its own
# ---------------------------------------------------------------------------------------------
def _config_from_hf(hf: Mapping[str, Any], padded_vocab_size: int = 0) -> tuple[VisionConfig, str]:
    archs = [str(a) for a in (hf.get("architectures") or [])]
    if archs and CLIP_VISION not in archs:
        raise UnsupportedModelError(f"architecture {archs!r} is not supported here ({CLIP_VISION} is)")
    return vision_config_from_hf(hf), CLIP_VISION


def _from_hf(hf: Mapping[str, torch.Tensor], cfg: VisionConfig, architecture: str = CLIP_VISION
             ) -> dict[str, torch.Tensor]:
    take = TensorTaker(_strip(hf, "vision_model."), _IGNORED_SUFFIXES)
    sd = vision_from_hf_state_dict(take, cfg)
    take.refuse_unused("megatrain's vision encoder")
    return sd


def _to_hf(sd: Mapping[str, torch.Tensor], cfg: VisionConfig, architecture: str = CLIP_VISION,
           vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    return vision_to_hf_state_dict(sd, cfg)


def _accepts(hf: Mapping[str, Any]) -> bool:
    return hf.get("model_type") == VISION_MODEL_TYPE or CLIP_VISION in (hf.get("architectures") or [])


CLIP_VISION_ADAPTER = HFAdapter(architectures=(CLIP_VISION,), accepts=_accepts, architecture=clip_vision_architecture,
                                config_dict=clip_vision_config_dict, to_hf_state_dict=_to_hf,
                                config_from_hf=_config_from_hf, from_hf_state_dict=_from_hf, generation_config=False)
