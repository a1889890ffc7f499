"""Mapping between the LLaVA family's LlavaModel and Hugging Face's ``LlavaForConditionalGeneration``
(``model_type`` "llava"): a CLIP vision tower, the multimodal projector and a LlamaForCausalLM or
MistralForCausalLM text model.

Pure tensor and dict code (``transformers`` is not imported). The language model's names and layouts
are the GPT family's adapter's (:mod:`megatrain.models.gpt.hf`), the vision tower's those of
:mod:`megatrain.models.llava.hf_clip`; this module only places them:

=====================================  ===========================================================
megatrain                              Hugging Face's files, as transformers 5 writes them
=====================================  ===========================================================
vision_model.*                         vision_tower.* (transformers 4's files:
                                       vision_tower.vision_model.*; both are read)
projector.linear_fc1, linear_fc2       multi_modal_projector.linear_1, linear_2
language_model.* (GPTModel)            language_model.* as LlamaForCausalLM's names (model.layers,
                                       lm_head, ...)
=====================================  ===========================================================

A loaded model's own names (``model.vision_tower.*``, ``model.language_model.*``, ``lm_head``) are
read too.

What the two share: ``vision_feature_layer`` and ``vision_feature_select_strategy`` mean the same
(:class:`~megatrain.models.llava.config.LlavaConfig`), the projector is Linear-GELU-Linear of the
language model's width (``projector_hidden_act`` "gelu"), ``image_token_index`` is our
``image_token_id`` (a real vocabulary id: Megatron's -200 cannot be exported by :func:`llava_to_hf`; the family's
:data:`FAMILY_ADAPTER`, which the folder converters use, writes the tokenizer's ``<image>`` id instead), and Hugging Face's
input ids already hold ``image_seq_length`` placeholders per image, which our forward takes as
they are. A Mistral text model with a sliding window goes back as Mistral, one without as Llama
(the same function). Anything else is refused with one line naming the field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megatrain.models.common.hf_adapter import HFAdapter, UnsupportedModelError
from megatrain.models.common.init import canonical_parameter_name
from megatrain.models.gpt import hf as gpt_hf
from megatrain.models.llava.config import MEGATRON_IMAGE_TOKEN_ID, LlavaConfig
from megatrain.models.llava.hf_clip import (CLIP_VISION_ADAPTER, TensorTaker, clip_vision_architecture,
                                            clip_vision_config_dict, vision_config_from_hf, vision_from_hf_state_dict,
                                            vision_to_hf_state_dict)
from megatrain.models.llava.model import LlavaModel
from megatrain.models.llava.vision import VisionEncoder

__all__ = ["ADAPTER", "FAMILY_ADAPTER", "LlavaHFAdapter", "LLAVA", "hf_architecture", "hf_config_dict",
           "llava_config_from_hf", "to_hf_state_dict",
           "from_hf_state_dict", "llava_from_hf", "llava_to_hf", "vision_encoder_from_hf"]

LLAVA = "LlavaForConditionalGeneration"
MODEL_TYPE = "llava"
TEXT_ARCHITECTURES = (gpt_hf.LLAMA, gpt_hf.MISTRAL)
_TEXT_MODEL_TYPES = ("llama", "mistral")

# LlavaConfig's defaults, for keys a config.json leaves out
_HF_DEFAULTS: dict[str, Any] = {"image_token_index": 32000, "projector_hidden_act": "gelu",
                                "vision_feature_select_strategy": "default", "vision_feature_layer": -2,
                                "multimodal_projector_bias": True}
# the module names of a loaded transformers 5 model -> the files' names (the first matching prefix is replaced)
_MODULE_PREFIXES = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                    ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."))
_VISION, _PROJECTOR, _TEXT = "vision_tower.", "multi_modal_projector.", "language_model."
_IGNORED_SUFFIXES = ("embeddings.position_ids", "rotary_emb.inv_freq")


# ---------------------------------------------------------------------------------------------
# choosing the Hugging Face classes
# ---------------------------------------------------------------------------------------------
def text_architecture(cfg: LlavaConfig) -> str:
    """The text model's class: LlamaForCausalLM or MistralForCausalLM (the GPT adapter's choice)."""
    arch = gpt_hf.hf_architecture(cfg.language)
    if arch not in TEXT_ARCHITECTURES:
        raise UnsupportedModelError(f"the language model exports as {arch}; {LLAVA} is converted with a "
                                    f"{' or '.join(TEXT_ARCHITECTURES)} text model")
    return arch


def hf_architecture(cfg: LlavaConfig) -> str:
    """LlavaForConditionalGeneration; UnsupportedModelError naming what it cannot express."""
    needs = {
        "projector_type 'mlp' (Linear-GELU-Linear; 'affine' has no Hugging Face class)": cfg.projector_type == "mlp",
        "projector_ffn_hidden_size = the language model's hidden size":
            cfg.projector_ffn_hidden_size == cfg.language.hidden_size,
        f"image_token_id a vocabulary id (0 ... {cfg.language.vocab_size - 1}; got {cfg.image_token_id})":
            0 <= cfg.image_token_id < cfg.language.vocab_size,
    }
    missing = [k for k, ok in needs.items() if not ok]
    if missing:
        raise UnsupportedModelError(f"this LLaVA model has no exact {LLAVA} equivalent: it needs " + "; ".join(missing))
    clip_vision_architecture(cfg.vision)
    text_architecture(cfg)
    return LLAVA


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------
def hf_config_dict(cfg: LlavaConfig, architecture: str = LLAVA, *, vocab_size: int | None = None,
                   dtype: str = "float32", bos_token_id: int | None = None, eos_token_id: int | None = None,
                   pad_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` content for ``cfg`` with ``vocab_size`` text vocabulary rows."""
    if architecture != LLAVA:
        raise UnsupportedModelError(f"unknown architecture {architecture!r}")
    hf_architecture(cfg)
    rows = vocab_size or cfg.language.vocab_size
    if not 0 <= cfg.image_token_id < rows:
        raise UnsupportedModelError(f"image_token_id {cfg.image_token_id} is not among the {rows} exported "
                                    "vocabulary rows (--vocab-size)")
    text = gpt_hf.hf_config_dict(cfg.language, text_architecture(cfg), vocab_size=rows, dtype=dtype,
                                 bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    text.pop("architectures", None)
    vision = clip_vision_config_dict(cfg.vision, dtype=dtype)
    vision.pop("architectures", None)
    return {
        "architectures": [LLAVA],
        "model_type": MODEL_TYPE,
        "text_config": text,
        "vision_config": vision,
        "image_token_index": cfg.image_token_id,
        "image_seq_length": cfg.tokens_per_image,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": cfg.projector_bias,
        "vision_feature_layer": cfg.vision_feature_layer,
        "vision_feature_select_strategy": cfg.vision_feature_select_strategy,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "torch_dtype": dtype,
    }


def llava_config_from_hf(hf: Mapping[str, Any], vocab_size: int) -> tuple[LlavaConfig, str]:
    """LlavaConfig (the text vocabulary padded to ``vocab_size``) and the class of a LLaVA config dict."""
    archs = [str(a) for a in (hf.get("architectures") or [])]
    if archs and LLAVA not in archs:
        raise UnsupportedModelError(f"architecture {archs!r} is not supported: the LLaVA family converts {LLAVA}")
    if hf.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise UnsupportedModelError(f"config.json field model_type: {hf.get('model_type')!r} is not {MODEL_TYPE!r}")

    def get(key: str) -> Any:
        value = hf.get(key)
        return _HF_DEFAULTS[key] if value is None else value

    act = get("projector_hidden_act")
    if act != "gelu":
        raise UnsupportedModelError(f"config.json field projector_hidden_act: {act!r} is not supported (megatrain's "
                                    "projector is Linear-GELU-Linear with exact GELU, \"gelu\")")
    image_token = hf.get("image_token_index", hf.get("image_token_id"))
    image_token = _HF_DEFAULTS["image_token_index"] if image_token is None else image_token
    if isinstance(image_token, bool) or not isinstance(image_token, int):
        raise UnsupportedModelError(f"config.json field image_token_index: expected an integer, got {image_token!r}")
    bias = get("multimodal_projector_bias")
    if not isinstance(bias, bool):
        raise UnsupportedModelError(f"config.json field multimodal_projector_bias: expected true or false, "
                                    f"got {bias!r}")
    vision_hf = hf.get("vision_config")
    text_hf = hf.get("text_config")
    for key, value in (("vision_config", vision_hf), ("text_config", text_hf)):
        if not isinstance(value, Mapping):
            raise UnsupportedModelError(f"config.json field {key}: expected an object, got {value!r}")
    assert isinstance(vision_hf, Mapping) and isinstance(text_hf, Mapping)
    text = dict(text_hf)
    text.setdefault("model_type", "llama")
    if text["model_type"] not in _TEXT_MODEL_TYPES:
        raise UnsupportedModelError(f"config.json field text_config.model_type: {text['model_type']!r} is not "
                                    f"supported ({' or '.join(_TEXT_MODEL_TYPES)})")
    text.pop("architectures", None)
    # transformers ties lm_head to the embeddings when either level asks for it
    text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings") or text_hf.get("tie_word_embeddings"))
    try:
        language, _ = gpt_hf.gpt_config_from_hf(text, vocab_size)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"text_config: {e}") from None
    vision = vision_config_from_hf(vision_hf, field="vision_config.", post_layernorm="pooled")
    try:
        cfg = LlavaConfig(language=language, vision=vision, projector_type="mlp", projector_bias=bias,
                          image_token_id=image_token, pad_token_id=1 if image_token == 0 else 0,
                          vision_feature_layer=get("vision_feature_layer"),
                          vision_feature_select_strategy=get("vision_feature_select_strategy"))
    except ValueError as e:
        raise UnsupportedModelError(f"config.json describes no valid LLaVA model: {e}") from None
    return cfg, LLAVA


# ---------------------------------------------------------------------------------------------
# state dicts
# ---------------------------------------------------------------------------------------------
def _file_names(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensor names as transformers 5 writes them (from a loaded model's names, or older files')."""
    out = {}
    for name, t in hf.items():
        for old, new in _MODULE_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if name.startswith(_VISION + "vision_model."):
            name = _VISION + name[len(_VISION + "vision_model."):]
        out[name] = t
    return out


def _part(sd: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def _projector_names(cfg: LlavaConfig) -> list[tuple[str, str]]:
    kinds = ("weight", "bias") if cfg.projector_bias else ("weight",)
    return [(f"projector.linear_fc{i}.{kind}", f"{_PROJECTOR}linear_{i}.{kind}") for i in (1, 2) for kind in kinds]


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: LlavaConfig, architecture: str = LLAVA,
                     vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Our state dict (canonical names, full tensors) -> LlavaForConditionalGeneration's names
    (transformers 5's), ``vocab_size`` rows of the text embedding and output layer."""
    hf_architecture(cfg)
    out = {_VISION + k: v for k, v in vision_to_hf_state_dict(_part(sd, "vision_model."), cfg.vision).items()}
    for ours, theirs in _projector_names(cfg):
        out[theirs] = sd[ours]
    text = gpt_hf.to_hf_state_dict(_part(sd, "language_model."), cfg.language, text_architecture(cfg), vocab_size)
    out.update({_TEXT + name: t for name, t in text.items()})  # LlamaForCausalLM's model.* and lm_head
    return out


def from_hf_state_dict(hf: Mapping[str, torch.Tensor], cfg: LlavaConfig, architecture: str = LLAVA
                       ) -> dict[str, torch.Tensor]:
    """LlavaForConditionalGeneration's tensors (either naming) -> our canonical state dict (the text
    vocabulary zero-padded to cfg's size). UnsupportedModelError on missing or unexpected tensors."""
    take = TensorTaker(_file_names(hf), _IGNORED_SUFFIXES)
    sd = {"vision_model." + k: v for k, v in vision_from_hf_state_dict(lambda n: take(_VISION + n), cfg.vision).items()}
    for ours, theirs in _projector_names(cfg):
        sd[ours] = take(theirs)
    text = {n[len(_TEXT):]: take(n) for n in list(take.tensors) if n.startswith(_TEXT)}
    language = gpt_hf.from_hf_state_dict(text, cfg.language, text_architecture(cfg))  # refuses unused text tensors
    sd.update({"language_model." + k: v for k, v in language.items()})
    take.refuse_unused("megatrain's LLaVA model")
    return sd


# ---------------------------------------------------------------------------------------------
# whole models
# ---------------------------------------------------------------------------------------------
def llava_from_hf(hf_config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *,
                  vocab_size: int | None = None) -> LlavaModel:
    """A LlavaModel holding a Hugging Face LLaVA's weights (its config.json as a dict, its tensors by
    name); ``vocab_size``: the padded text vocabulary (default: the folder's)."""
    text_vocab = (hf_config.get("text_config") or {}).get("vocab_size") or 32000
    cfg, architecture = llava_config_from_hf(hf_config, vocab_size or int(text_vocab))
    sd = from_hf_state_dict(tensors, cfg, architecture)
    with torch.device("meta"):
        model = LlavaModel(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    return model


def vision_encoder_from_hf(hf_config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> VisionEncoder:
    """A VisionEncoder holding a Hugging Face CLIPVisionModel's weights (post_layernorm "pooled")."""
    cfg, architecture = CLIP_VISION_ADAPTER.config_from_hf(hf_config, 0)
    sd = CLIP_VISION_ADAPTER.from_hf_state_dict(tensors, cfg, architecture)
    with torch.device("meta"):
        encoder = VisionEncoder(cfg)
    encoder.load_state_dict(sd, strict=True, assign=True)
    return encoder


def llava_to_hf(model: LlavaModel, *, vocab_size: int | None = None, dtype: str = "float32",
                bos_token_id: int | None = None, eos_token_id: int | None = None,
                pad_token_id: int | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json content, tensors by Hugging Face name) of ``model`` as LlavaForConditionalGeneration."""
    sd = {canonical_parameter_name(k): v.detach() for k, v in model.state_dict().items()}
    config = hf_config_dict(model.config, LLAVA, vocab_size=vocab_size, dtype=dtype, bos_token_id=bos_token_id,
                            eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    return config, to_hf_state_dict(sd, model.config, LLAVA, vocab_size)


def _accepts(hf: Mapping[str, Any]) -> bool:
    return hf.get("model_type") == MODEL_TYPE or LLAVA in (hf.get("architectures") or [])


def _config_dict(cfg: LlavaConfig, architecture: str, *, vocab_size: int, dtype: str, **ids: Any) -> dict[str, Any]:
    return hf_config_dict(cfg, architecture, vocab_size=vocab_size, dtype=dtype, **ids)


ADAPTER = HFAdapter(architectures=(LLAVA,), accepts=_accepts, architecture=hf_architecture, config_dict=_config_dict,
                    to_hf_state_dict=to_hf_state_dict, config_from_hf=llava_config_from_hf,
                    from_hf_state_dict=from_hf_state_dict)


# ---------------------------------------------------------------------------------------------
# the family's adapter (tools/convert_checkpoint_to_hf.py, tools/convert_hf_to_checkpoint.py, --load hf:DIR)
# ---------------------------------------------------------------------------------------------
def _checked(cfg: LlavaConfig) -> LlavaConfig:
    """``cfg``, with Megatron's placeholder id (-200, what ``pretrain_vlm.py`` trains with) as some vocabulary
    id for :func:`hf_architecture`'s checks: the export writes the tokenizer's ``<image>`` token id in its
    place (:func:`_image_token_ids`), which is the same model (those positions never read an embedding row)."""
    if cfg.image_token_id != MEGATRON_IMAGE_TOKEN_ID:
        return cfg
    import dataclasses

    return dataclasses.replace(cfg, image_token_id=cfg.pad_token_id + 1)


def _family_architecture(cfg: LlavaConfig) -> str:
    return hf_architecture(_checked(cfg))


def _family_to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: LlavaConfig, architecture: str = LLAVA,
                             vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    return to_hf_state_dict(sd, _checked(cfg), architecture, vocab_size)


def _image_token_ids(tokenizer: Any) -> dict[str, int]:
    """The ``<image>`` token's id, written as ``image_token_index`` for a model trained with -200."""
    from megatrain.data.multimodal.conversation import IMAGE_PLACEHOLDER, _single_token_id

    image = _single_token_id(tokenizer, IMAGE_PLACEHOLDER)
    return {} if image is None else {"image_token_index": int(image)}


def _family_config_dict(cfg: LlavaConfig, architecture: str, *, vocab_size: int, dtype: str,
                        image_token_index: int | None = None, **ids: Any) -> dict[str, Any]:
    if cfg.image_token_id == MEGATRON_IMAGE_TOKEN_ID:
        if image_token_index is None:
            raise UnsupportedModelError(
                f"image_token_id {MEGATRON_IMAGE_TOKEN_ID} (Megatron's placeholder) is no vocabulary id: the export "
                "writes the tokenizer's <image> token as image_token_index, and the tokenizer has no single <image> "
                "token (or cannot be opened: pass --tokenizer-type / --tokenizer-model)")
        import dataclasses

        cfg = dataclasses.replace(cfg, image_token_id=image_token_index,
                                  pad_token_id=1 if image_token_index == 0 else 0)
    config = hf_config_dict(cfg, architecture, vocab_size=vocab_size, dtype=dtype, **ids)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # generation_config.json's, at the top as well
        config[key] = config["text_config"].get(key)
    return config


def _family_flags(cfg: LlavaConfig) -> list[str]:
    """``pretrain_vlm.py``'s flags of the vision encoder and the projector (after the language model's)."""
    v = cfg.vision
    flags = ["--vision-num-layers", str(v.num_layers), "--vision-hidden-size", str(v.hidden_size),
             "--vision-num-attention-heads", str(v.num_attention_heads),
             "--vision-ffn-hidden-size", str(v.ffn_hidden_size), "--patch-dim", str(v.patch_dim),
             "--img-h", str(v.img_h), "--img-w", str(v.img_w), "--vision-projection-type", cfg.projector_type]
    if isinstance(cfg.vision_feature_layer, int):
        flags += ["--vision-feature-layer", str(cfg.vision_feature_layer)]
    if cfg.disable_vision_class_token:
        flags += ["--disable-vision-class-token"]
    return flags


def _preprocessor_config(cfg: LlavaConfig, saved_args: Mapping[str, Any]) -> dict[str, Any]:
    """``preprocessor_config.json`` (transformers' CLIPImageProcessor) for the images the model was trained
    on: its run's ``--image-processor`` file, else CLIP's defaults at the ViT's ``img_h``, as megatrain's
    loader and ``tools/generate.py --image`` preprocess."""
    from megatrain.data.multimodal.image_processing import CLIPImageConfig

    path = saved_args.get("image_processor")
    if path:
        file = os.path.join(path, "preprocessor_config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise UnsupportedModelError(f"the checkpoint's --image-processor {path}: no such file (its run "
                                        "preprocessed the images with it; it is written as preprocessor_config.json)")
        CLIPImageConfig.from_pretrained(path)  # one that megatrain reads
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    size = cfg.vision.img_h
    d = CLIPImageConfig.default(size)
    return {"image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
            "size": {"shortest_edge": size}, "crop_size": {"height": size, "width": size},
            "do_resize": True, "do_center_crop": True, "do_rescale": True, "do_normalize": True,
            "do_convert_rgb": True, "resample": d.resample, "rescale_factor": d.rescale_factor,
            "image_mean": list(d.image_mean), "image_std": list(d.image_std)}


def _extra_files(cfg: LlavaConfig, saved_args: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """preprocessor_config.json, and processor_config.json: LlavaProcessor's own settings (how many
    ``<image>`` tokens one image becomes: the patches, plus the class token unless the strategy drops it)."""
    processor = {"processor_class": "LlavaProcessor", "image_token": "<image>", "patch_size": cfg.vision.patch_dim,
                 "vision_feature_select_strategy": cfg.vision_feature_select_strategy,
                 "num_additional_image_tokens": cfg.vision.class_token_len}
    return {"preprocessor_config.json": _preprocessor_config(cfg, saved_args), "processor_config.json": processor}


@dataclass(frozen=True)
class LlavaHFAdapter(HFAdapter):
    # Export: (config, the checkpoint's saved args) -> {file name: JSON content} written beside config.json
    extra_files: Callable[..., dict[str, Any]] | None = None


#: What the LLaVA family registers: :data:`ADAPTER` taking ``pretrain_vlm.py``'s -200 image id (exported as
#: the tokenizer's ``<image>`` id), with ``pretrain_vlm.py``'s flags and the CLIP preprocessor config.
FAMILY_ADAPTER = LlavaHFAdapter(
    architectures=(LLAVA,), accepts=_accepts, architecture=_family_architecture, config_dict=_family_config_dict,
    to_hf_state_dict=_family_to_hf_state_dict, config_from_hf=llava_config_from_hf,
    from_hf_state_dict=from_hf_state_dict,
    special_token_ids=_image_token_ids, script="pretrain_vlm.py", family_flags=_family_flags,
    extra_files=_extra_files)
