"""The LLaVA family <-> Hugging Face, offline on tiny random models (fp32, CPU): a CLIPVisionModel folder
imports with the same hidden states and pooled output; a LlavaForConditionalGeneration folder (Llama or
Mistral text model) imports with the same logits on the same pixel_values and input_ids (Hugging Face's
expanded placeholders, and our compact ones); an exported model loads in transformers with nothing
missing and gives the same logits; export -> import is exact; refusals are one line naming the field."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain.convert.export_hf import write_safetensors  # noqa: E402
from megatrain.convert.import_hf import read_hf_config, read_hf_weights  # noqa: E402
from megatrain.models.common.hf_adapter import UnsupportedModelError  # noqa: E402
from megatrain.models.gpt import GPTConfig  # noqa: E402
from megatrain.models.llava import LlavaConfig, LlavaModel, VisionConfig, expand_image_tokens  # noqa: E402
from megatrain.models.llava.hf import (ADAPTER, from_hf_state_dict, llava_config_from_hf, llava_from_hf,  # noqa: E402
                                       llava_to_hf, vision_encoder_from_hf)
from megatrain.models.llava.hf_clip import CLIP_VISION_ADAPTER, clip_vision_config_dict  # noqa: E402

IMAGE, V = 90, 96


def clip_config(**overrides):
    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=16,
                  patch_size=4, hidden_act="quick_gelu", layer_norm_eps=1e-5)
    return transformers.CLIPVisionConfig(**{**fields, **overrides})


def text_config(kind: str, tied: bool = False):
    fields = dict(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=tied)
    if kind == "mistral":
        return transformers.MistralConfig(**fields, sliding_window=6)
    return transformers.LlamaConfig(**fields)


def hf_llava_config(kind: str = "llama", *, tied: bool = False, layer=-2, strategy: str = "default",
                    act: str = "quick_gelu"):
    return transformers.LlavaConfig(vision_config=clip_config(hidden_act=act), text_config=text_config(kind, tied),
                                    image_token_index=IMAGE, image_seq_length=16 if strategy == "default" else 17,
                                    vision_feature_layer=layer, vision_feature_select_strategy=strategy,
                                    projector_hidden_act="gelu", tie_word_embeddings=tied)


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter moved off its initial value (norms away from 1, biases from 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def pixels(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def compact_tokens() -> torch.Tensor:
    """Row 0: one image; row 1: two images; row 2: text only (ids below the placeholder)."""
    return torch.tensor([[5, 6, IMAGE, 7, 8, 9, 10, 11],
                         [IMAGE, 12, 13, IMAGE, 14, 15, 16, 17],
                         [18, 19, 20, 21, 22, 23, 24, 25]])


def hf_input_ids(per_image: int) -> torch.Tensor:
    """What Hugging Face's processor gives: each placeholder repeated (rows right-padded with 0)."""
    return expand_image_tokens(compact_tokens(), 3, image_token_id=IMAGE, tokens_per_image=per_image).tokens


def save_hf(model, tmp_path, name: str = "hf"):
    out = tmp_path / name
    model.save_pretrained(str(out), safe_serialization=True)
    return read_hf_config(str(out)), read_hf_weights(str(out))


# ---- CLIPVisionModel ----------------------------------------------------------------------------

@pytest.mark.parametrize("act", ["quick_gelu", "gelu"])
def test_clip_vision_import_matches_transformers(act, tmp_path):
    torch.manual_seed(0)
    hf = perturbed(transformers.CLIPVisionModel(clip_config(hidden_act=act)))
    config, tensors = save_hf(hf, tmp_path)
    assert CLIP_VISION_ADAPTER.accepts(config)
    encoder = vision_encoder_from_hf(config, tensors).eval()
    assert encoder.config.activation == act and encoder.config.post_layernorm == "pooled"
    x = pixels(2)
    with torch.no_grad():
        theirs = hf(pixel_values=x, output_hidden_states=True)
        states = encoder.hidden_states(x)
        ours = encoder(x)
    assert (ours - theirs.last_hidden_state).abs().max() < 1e-4
    assert (encoder.pooled(ours) - theirs.pooler_output).abs().max() < 1e-4
    assert len(states) == len(theirs.hidden_states) == 4
    for a, b in zip(states, theirs.hidden_states):
        assert (a - b).abs().max() < 1e-4
    # and back: the same tensors under the same names
    again = CLIP_VISION_ADAPTER.to_hf_state_dict(encoder.state_dict(), encoder.config, "CLIPVisionModel")
    for name, t in again.items():
        assert torch.equal(t, tensors.get(name, tensors.get("vision_model." + name))), name


# ---- LlavaForConditionalGeneration --------------------------------------------------------------

CASES = {  # text model, tied embeddings, vision_feature_layer, strategy, CLIP activation
    "llama": ("llama", False, -2, "default", "quick_gelu"),
    "mistral_tied_full": ("mistral", True, -1, "full", "gelu"),
    "llama_layers": ("llama", False, [0, -2], "default", "quick_gelu"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_llava_import_matches_transformers(case, tmp_path):
    kind, tied, layer, strategy, act = CASES[case]
    torch.manual_seed(0)
    hf = perturbed(transformers.LlavaForConditionalGeneration(hf_llava_config(kind, tied=tied, layer=layer,
                                                                              strategy=strategy, act=act)))
    config, tensors = save_hf(hf, tmp_path)
    assert ADAPTER.accepts(config)
    model = llava_from_hf(config, tensors).eval()
    cfg = model.config
    assert cfg.language.untie_embeddings_and_output_weights is not tied
    assert cfg.language.window_size == ((5, 0) if kind == "mistral" else None)
    per_image = cfg.tokens_per_image
    ids, x = hf_input_ids(per_image), pixels(3)
    with torch.no_grad():
        theirs = hf(input_ids=ids, pixel_values=x).logits
        ours = model(ids, x)  # the placeholders already expanded, as Hugging Face's
        compact = model(compact_tokens(), x)  # one placeholder per image, expanded by the model
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() < 1e-4
    assert (compact - theirs).abs().max() < 1e-4


@pytest.mark.parametrize("style", ["untied", "tied"])
def test_export_loads_in_transformers_with_the_same_logits(style, tmp_path):
    language = GPTConfig(num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2, vocab_size=V,
                         ffn_hidden_size=64, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                         add_bias_linear=False, untie_embeddings_and_output_weights=style == "untied",
                         hidden_dropout=0.0, attention_dropout=0.0, norm_epsilon=1e-6, max_position_embeddings=256)
    vision = VisionConfig(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, patch_dim=4,
                          img_h=16, img_w=16, post_layernorm="none" if style == "tied" else "pooled")
    cfg = LlavaConfig(language=language, vision=vision, image_token_id=IMAGE)
    torch.manual_seed(0)
    model = perturbed(LlavaModel(cfg))
    config, tensors = llava_to_hf(model)
    out = tmp_path / "export"
    out.mkdir()
    write_safetensors(tensors, str(out), 10**12, progress=False)
    (out / "config.json").write_text(json.dumps(config))
    hf, info = transformers.LlavaForConditionalGeneration.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf.eval()
    ids, x = hf_input_ids(cfg.tokens_per_image), pixels(3)
    with torch.no_grad():
        theirs = hf(input_ids=ids, pixel_values=x).logits
        ours = model(compact_tokens(), x)
    assert (ours - theirs).abs().max() < 1e-4
    # export -> import is exact
    back = llava_from_hf(config, tensors)
    expected, imported = model.state_dict(), back.state_dict()
    for name, t in expected.items():
        assert torch.equal(imported[name], t), name
    if vision.post_layernorm == "none":  # written as the identity for CLIP's pooler, read back as ln_post
        assert set(imported) - set(expected) == {"vision_model.ln_post.weight", "vision_model.ln_post.bias"}
        assert (imported["vision_model.ln_post.weight"] == 1).all() and (imported["vision_model.ln_post.bias"] == 0).all()


# ---- refusals -----------------------------------------------------------------------------------

def _dict(**changes) -> dict:
    config = hf_llava_config().to_dict()
    for path, value in changes.items():
        where = config
        *parents, key = path.split("__")
        for part in parents:
            where = where[part]
        where[key] = value
    return config


@pytest.mark.parametrize("changes, message", [
    ({"projector_hidden_act": "relu"}, "config.json field projector_hidden_act"),
    ({"text_config__model_type": "qwen2"}, "config.json field text_config.model_type"),
    ({"text_config__hidden_act": "gelu"}, "text_config: hidden_act 'gelu'"),
    ({"vision_config__hidden_act": "relu"}, "config.json field vision_config.hidden_act"),
    ({"vision_config__model_type": "siglip_vision_model"}, "config.json field vision_config.model_type"),
    ({"vision_config__image_size": [16, 16]}, "config.json field vision_config.image_size: expected one integer"),
    ({"vision_feature_select_strategy": "crop"}, "vision_feature_select_strategy must be default or full"),
    ({"vision_feature_layer": 7}, "vision_feature_layer 7 is out of range"),
    ({"architectures": ["LlavaNextForConditionalGeneration"]}, "the LLaVA family converts"),
])
def test_import_refusals_name_the_field(changes, message):
    with pytest.raises(UnsupportedModelError, match=message) as e:
        llava_config_from_hf(_dict(**changes), V)
    assert "\n" not in str(e.value)


def test_unexpected_tensors_are_refused():
    torch.manual_seed(0)
    cfg, _ = llava_config_from_hf(hf_llava_config().to_dict(), V)
    config, tensors = llava_to_hf(LlavaModel(cfg))
    tensors["model.multi_modal_projector.extra.weight"] = torch.zeros(2)
    with pytest.raises(UnsupportedModelError, match="no place for .*extra"):
        from_hf_state_dict(tensors, cfg)


@pytest.mark.parametrize("changes, message", [
    ({"projector_type": "affine"}, "projector_type 'mlp'"),
    ({"image_token_id": -200}, "image_token_id a vocabulary id"),
    ({"vision": dict(img_h=16, img_w=12, patch_dim=4)}, r"a square image \(img_h = img_w"),
    ({"vision": dict(post_layernorm="all")}, "post_layernorm 'pooled' or 'none'"),
])
def test_export_refusals_name_the_field(changes, message):
    changes = dict(changes)
    base = dict(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, patch_dim=4, img_h=16,
                img_w=16)
    vision = VisionConfig(**{**base, **changes.pop("vision", {})})
    language = GPTConfig(num_layers=1, hidden_size=48, num_attention_heads=4, vocab_size=V, swiglu=True,
                         normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False)
    cfg = LlavaConfig(language=language, vision=vision, **{"image_token_id": IMAGE, **changes})
    with pytest.raises(UnsupportedModelError, match=message) as e:
        ADAPTER.architecture(cfg)
    assert "\n" not in str(e.value)
    if changes.get("projector_type") is None and "image_token_id" not in changes:
        with pytest.raises(UnsupportedModelError):
            clip_vision_config_dict(vision)


@pytest.mark.parametrize("naming", ["loaded_module", "transformers_4"])
def test_other_tensor_namings_import_the_same(naming):
    torch.manual_seed(0)
    cfg, _ = llava_config_from_hf(hf_llava_config().to_dict(), V)
    model = perturbed(LlavaModel(cfg))
    _, tensors = llava_to_hf(model)
    if naming == "loaded_module":  # a transformers 5 model's own state_dict names
        renames = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                   ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))
    else:  # the Hub's llava-1.5 files
        renames = (("vision_tower.", "vision_tower.vision_model."),)
    renamed = {}
    for name, t in tensors.items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        renamed[name] = t
    assert set(renamed) != set(tensors)
    sd = from_hf_state_dict(renamed, cfg)
    for name, t in model.state_dict().items():
        assert torch.equal(sd[name], t), name
