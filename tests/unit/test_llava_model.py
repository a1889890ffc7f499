"""The LLaVA family's model, offline on tiny random configs (fp32, CPU): the CLIP ViT's pieces, the image
placeholders expanded (compact and already-expanded text give the same logits), the projected features in
place of the image positions, labels and loss masks moved with them, the feature layer and strategy,
initialisation, the FLOPs formula against torch's counter, and the config checks naming their fields.
(Equality with transformers' CLIPVisionModel and LlavaForConditionalGeneration: test_llava_hf.py.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatrain.models.common.flops import transformer_flops
from megatrain.models.common.layer_stacks import layer_stacks, transformer_layers
from megatrain.models.gpt import GPTConfig, GPTModel
from megatrain.models.llava import (IGNORE_INDEX, LlavaConfig, LlavaModel, VisionConfig, VisionEncoder,
                                    answer_loss_mask, expand_image_tokens, initial_value)
from megatrain.models.llava.flops import num_floating_point_operations, projector_flops, vision_flops
from megatrain.models.llava.vision import VisionMLP, quick_gelu

IMAGE = 90  # the placeholder id in these tests' vocabulary of 96


def vision_config(**overrides) -> VisionConfig:
    fields = dict(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, patch_dim=4, img_h=16,
                  img_w=16)
    return VisionConfig(**{**fields, **overrides})


def language_config(style: str = "llama", **overrides) -> GPTConfig:
    if style == "llama":
        fields = dict(num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2, vocab_size=96,
                      ffn_hidden_size=64, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                      attention_dropout=0.0, max_position_embeddings=256)
    else:  # GPT-2 style: learned positions
        fields = dict(num_layers=2, hidden_size=48, num_attention_heads=4, vocab_size=96, max_position_embeddings=64,
                      hidden_dropout=0.0, attention_dropout=0.0)
    return GPTConfig(**{**fields, **overrides})


def llava_config(style: str = "llama", vision: dict | None = None, **overrides) -> LlavaConfig:
    return LlavaConfig(language=language_config(style), vision=vision_config(**(vision or {})), image_token_id=IMAGE,
                       **overrides)


def model_of(cfg: LlavaConfig, seed: int = 0) -> LlavaModel:
    torch.manual_seed(seed)
    model = LlavaModel(cfg).eval()
    with torch.no_grad():  # norms and biases away from 1 and 0, so that every weight matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def images(n: int, cfg: LlavaConfig, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = cfg.vision
    return torch.randn(n, v.num_channels, v.img_h, v.img_w, generator=g)


def compact_tokens() -> torch.Tensor:
    """Row 0: one image after two tokens; row 1: two images; row 2: text only."""
    return torch.tensor([[5, 6, IMAGE, 7, 8, 9, 10, 11],
                         [IMAGE, 12, 13, IMAGE, 14, 15, 16, 17],
                         [18, 19, 20, 21, 22, 23, 24, 25]])


# ---- the vision encoder ---------------------------------------------------------------------------

def test_vision_encoder_shapes_and_hidden_states():
    cfg = vision_config()
    encoder = VisionEncoder(cfg).eval()
    x = images(2, llava_config())
    assert cfg.num_patches == 16 and cfg.seq_length == 17 and cfg.max_position_embeddings == 17
    with torch.no_grad():
        out = encoder(x)
        states = encoder.hidden_states(x)
        two = encoder.hidden_states(x, 2)
    assert out.shape == (2, 17, 32) and len(states) == 4 and len(two) == 3
    assert torch.equal(states[-1], out)  # post_layernorm "none": the last layer's output
    for a, b in zip(two, states):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"images must be \[batch, 3, 16, 16\]"):
        encoder(torch.zeros(2, 3, 16, 12))


def test_patch_embedding_class_token_and_positions_written_out():
    cfg = vision_config(num_layers=1)
    encoder = model_of(LlavaConfig(language=language_config(), vision=cfg, image_token_id=IMAGE)).vision_model
    x = images(1, llava_config())
    p = cfg.patch_dim
    # patches row by row, each flattened as (channel, row, col): the conv without bias
    patches = x.unfold(2, p, p).unfold(3, p, p)  # [1, c, 4, 4, p, p]
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(1, 16, -1)
    embedded = patches @ encoder.conv1.weight.reshape(cfg.hidden_size, -1).t()
    embedded = torch.cat([encoder.class_token, embedded], dim=1) + encoder.position_embeddings.weight
    expected = F.layer_norm(embedded, (cfg.hidden_size,), encoder.ln_pre.weight, encoder.ln_pre.bias, 1e-5)
    with torch.no_grad():
        assert torch.allclose(encoder.embed(x), expected, atol=1e-5)


@pytest.mark.parametrize("activation, approximation", [("quick_gelu", "none"), ("gelu", "none"), ("gelu", "tanh")])
def test_vision_mlp_activation(activation, approximation):
    cfg = vision_config(activation=activation, gelu_approximation=approximation)
    mlp = VisionMLP(cfg)
    x = torch.randn(3, 32)
    y = mlp.linear_fc1(x)
    act = y * torch.sigmoid(1.702 * y) if activation == "quick_gelu" else F.gelu(y, approximate=approximation)
    with torch.no_grad():
        assert torch.allclose(mlp(x), mlp.linear_fc2(act), atol=1e-6)
    assert torch.allclose(quick_gelu(torch.tensor([0.0, 1.0])), torch.tensor([0.0, 1 / (1 + math.exp(-1.702))]))


def test_post_layernorm_all_and_pooled():
    x = images(2, llava_config())
    for where in ("all", "pooled"):
        encoder = VisionEncoder(vision_config(post_layernorm=where)).eval()
        with torch.no_grad():
            last = encoder.hidden_states(x)[-1]
            out, pooled = encoder(x), encoder.pooled(last)
        assert torch.allclose(pooled, encoder.ln_post(last[:, 0]))
        assert torch.allclose(out, encoder.ln_post(last) if where == "all" else last)
    with pytest.raises(ValueError, match="post_layernorm 'pooled'"):
        VisionEncoder(vision_config()).pooled(torch.zeros(1, 17, 32))


# ---- image placeholders -------------------------------------------------------------------------

def test_expand_compact_tokens_labels_and_loss_mask():
    tokens = torch.tensor([[5, IMAGE, 7, 8], [9, 10, 11, 12]])
    labels = torch.tensor([[IMAGE, 7, 8, 3], [10, 11, 12, 4]])
    mask = torch.ones(2, 4)
    out = expand_image_tokens(tokens, 1, image_token_id=IMAGE, tokens_per_image=3, pad_token_id=0, labels=labels,
                              loss_mask=mask)
    assert out.tokens.tolist() == [[5, IMAGE, IMAGE, IMAGE, 7, 8], [9, 10, 11, 12, 0, 0]]
    assert out.image_mask.tolist() == [[False, True, True, True, False, False], [False] * 6]
    assert out.lengths.tolist() == [6, 4]
    # the label of the image goes to its last position; predicting a placeholder counts nothing
    assert out.labels.tolist() == [[IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 7, 8, 3],
                                   [10, 11, 12, 4, IGNORE_INDEX, IGNORE_INDEX]]
    assert out.loss_mask.tolist() == [[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    # without labels the loss mask still leaves out the images and the position before one
    alone = expand_image_tokens(tokens, 1, image_token_id=IMAGE, tokens_per_image=3, loss_mask=mask)
    assert alone.labels is None and alone.loss_mask.tolist() == out.loss_mask.tolist()


def test_expanded_text_is_taken_as_it_is():
    tokens = torch.tensor([[5, IMAGE, IMAGE, IMAGE, 7]])
    labels = torch.tensor([[IMAGE, IMAGE, IMAGE, 7, 8]])
    out = expand_image_tokens(tokens, 1, image_token_id=IMAGE, tokens_per_image=3, labels=labels)
    assert torch.equal(out.tokens, tokens) and out.image_mask.sum() == 3
    assert out.labels.tolist() == [[IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 7, 8]]


def test_placeholder_count_must_match_the_images():
    with pytest.raises(ValueError, match="holds 2 image tokens .* for 1 images: expected one per image, or 3"):
        expand_image_tokens(torch.tensor([[IMAGE, IMAGE, 1]]), 1, image_token_id=IMAGE, tokens_per_image=3)


def test_answer_loss_mask():
    labels = torch.tensor([[1, 2, 3, 4, 0], [5, 6, 7, 8, 9]])
    mask = answer_loss_mask(labels, torch.tensor([3, 1]), pad_token_id=0)
    assert mask.tolist() == [[0, 0, 1, 1, 0], [1, 1, 1, 1, 1]]  # label i is sample token i + 1 (answer from 3)


# ---- the model ----------------------------------------------------------------------------------

def test_compact_and_expanded_text_give_the_same_logits():
    cfg = llava_config()
    model = model_of(cfg)
    tokens, x = compact_tokens(), images(3, cfg)
    layout = model.expand_tokens(tokens, 3)
    with torch.no_grad():
        compact = model(tokens, x)
        expanded = model(layout.tokens, x)
    assert compact.shape == (3, 8 + 2 * 15, 96)
    for row, n in enumerate(layout.lengths.tolist()):  # padding at the end: the real positions agree
        assert torch.allclose(compact[row, :n], expanded[row, :n], atol=1e-5)


def test_image_positions_hold_the_projected_features():
    cfg = llava_config()
    model = model_of(cfg)
    tokens, x = compact_tokens(), images(3, cfg)
    layout = model.expand_tokens(tokens, 3)
    positions = torch.arange(layout.tokens.shape[1]).unsqueeze(0)
    with torch.no_grad():
        features = model.image_features(x)
        hidden = model.embed(layout, features, positions)
        text = model.language_model.embed(layout.tokens, positions)
        logits = model(tokens, x)
        reference = model.language_model(None, positions, decoder_input=hidden)
    assert features.shape == (3, cfg.tokens_per_image, 48) and cfg.tokens_per_image == 16
    assert torch.equal(hidden[layout.image_mask], features.reshape(-1, 48))  # in reading order
    assert torch.equal(hidden[~layout.image_mask], text[~layout.image_mask])
    assert torch.allclose(logits, reference)
    # causal: the text before row 0's image is the language model's own
    with torch.no_grad():
        alone = model.language_model(tokens[:1, :2])
    assert torch.allclose(logits[0, :2], alone[0], atol=1e-5)


def test_gpt_decoder_input_hook_is_the_embedding_path():
    gpt = GPTModel(language_config("gpt2")).eval()
    tokens = torch.randint(0, 96, (2, 9))
    positions = torch.arange(9).unsqueeze(0)
    labels = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        assert torch.equal(gpt(tokens), gpt(None, decoder_input=gpt.embed(tokens, positions)))
        assert torch.equal(gpt(tokens, labels=labels),
                           gpt(None, positions, labels=labels, decoder_input=gpt.embed(tokens, positions)))


def test_text_only_batches_are_the_language_model():
    cfg = llava_config()
    model = model_of(cfg)
    tokens = compact_tokens()[2:]
    empty = torch.zeros(0, 3, 16, 16)
    with torch.no_grad():
        expected = model.language_model(tokens)
        assert torch.allclose(model(tokens), expected) and torch.allclose(model(tokens, empty), expected)
    with pytest.raises(ValueError, match="holds 1 image tokens .* for 0 images"):
        model(compact_tokens()[:1])


def test_labels_give_the_per_token_loss_of_the_expanded_sequence():
    cfg = llava_config()
    model = model_of(cfg)
    tokens, x = compact_tokens(), images(3, cfg)
    labels = torch.roll(tokens, -1, dims=1)
    layout = model.expand_tokens(tokens, 3, labels=labels, loss_mask=torch.ones(3, 8))
    with torch.no_grad():
        loss = model(tokens, x, labels=labels)
        logits = model(tokens, x)
    assert loss.shape == layout.tokens.shape and loss.dtype == torch.float32
    keep = layout.labels != IGNORE_INDEX
    expected = F.cross_entropy(logits[keep], layout.labels[keep], reduction="none")
    assert torch.allclose(loss[keep], expected, atol=1e-5) and (loss[~keep] == 0).all()
    assert torch.equal(layout.loss_mask.bool(), keep)


def test_backward_reaches_every_part():
    cfg = llava_config()
    model = model_of(cfg)
    tokens, x = compact_tokens(), images(3, cfg)
    layout = model.expand_tokens(tokens, 3, labels=torch.roll(tokens, -1, dims=1), loss_mask=torch.ones(3, 8))
    loss = model(layout.tokens, x, labels=layout.labels)
    (loss * layout.loss_mask).sum().backward()
    unused = {"vision_model.layers.2."}  # vision_feature_layer -2 of 3 layers: the last one never runs
    for name, p in model.named_parameters():
        if any(name.startswith(u) for u in unused):
            assert p.grad is None, name
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_learned_positions_count_after_the_expansion():
    cfg = llava_config("gpt2")
    model = model_of(cfg)
    tokens, x = compact_tokens(), images(3, cfg)
    with torch.no_grad():
        assert model(tokens, x).shape == (3, 38, 96)
    long = torch.full((1, 50), 7)
    long[0, 0] = IMAGE
    with pytest.raises(ValueError, match="65 positions .* longer than --max-position-embeddings"):
        model(long, x[:1])


@pytest.mark.parametrize("layer, strategy, width, count", [(-2, "default", 32, 16), (-1, "full", 32, 17),
                                                           ([0, -1], "default", 64, 16), (1, "full", 32, 17)])
def test_feature_layer_and_select_strategy(layer, strategy, width, count):
    cfg = llava_config(vision_feature_layer=layer, vision_feature_select_strategy=strategy)
    model = model_of(cfg)
    assert cfg.projector_input_size == width and cfg.tokens_per_image == count
    x = images(2, cfg)
    chosen = cfg.feature_layers
    with torch.no_grad():
        states = model.vision_model.hidden_states(x)
        picked = torch.cat([states[i][:, 17 - count:] for i in chosen], dim=-1)
        assert torch.allclose(model.image_features(x), model.projector(picked), atol=1e-6)
    assert cfg.vision_layers_run == max(chosen) and cfg.disable_vision_class_token is (strategy == "default")


def test_affine_projector_and_parameter_count():
    cfg = llava_config(projector_type="affine", projector_bias=False)
    model = model_of(cfg)
    assert model.projector.linear_fc2 is None and model.projector.linear_fc1.bias is None
    x = torch.randn(2, 5, 32)
    assert torch.equal(model.projector(x), x @ model.projector.linear_fc1.weight.t())
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    embeddings = model.language_model.embedding.word_embeddings.weight.numel() * 2  # untied output layer
    assert model.num_parameters(exclude_embeddings=True) == model.num_parameters() - embeddings


def test_layer_stacks_in_forward_order():
    model = model_of(llava_config())
    assert list(layer_stacks(model)) == ["vision_model.layers", "language_model.layers"]
    assert len(transformer_layers(model)) == 3 + 2


def test_initialisation_is_deterministic_and_layout_independent():
    cfg = llava_config()
    built = LlavaModel(cfg)
    with torch.device("meta"):
        meta = LlavaModel(cfg)
    meta.to_empty(device="cpu")
    meta.init_weights(seed=0)
    for (name, a), (_, b) in zip(built.named_parameters(), meta.named_parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(initial_value("_orig_mod." + name, a.shape, cfg, 0), a)
    params = dict(built.named_parameters())
    assert (params["vision_model.ln_pre.weight"] == 1).all() and (params["projector.linear_fc1.bias"] == 0).all()
    std = params["vision_model.layers.0.self_attention.linear_qkv.weight"].std().item()
    assert abs(std - 0.02) < 0.004
    with pytest.raises(ValueError, match="no initialisation rule"):
        initial_value("other.weight", (2,), cfg, 0)


@pytest.mark.parametrize("frozen", [(), ("vision",), ("projector",), ("vision", "projector"), ("language",),
                                    ("language", "vision")])
def test_flops_match_torchs_counter_over_forward_and_backward(frozen):
    """Our count of the encoder and projector equals torch's counter over the forward and the backward
    autograd runs with those parts frozen (weight gradients skipped, no backward before the first
    trained part); the language model is the GPT formula, without weight gradients when frozen."""
    cfg = llava_config(vision_feature_layer=-2, freeze_vision_model="vision" in frozen,
                       freeze_projector="projector" in frozen, freeze_language_model="language" in frozen)
    model = model_of(cfg)
    model.apply_freezing()
    x = images(2, cfg)
    # the math kernel, whose matmuls torch's counter sees (it counts no fused CPU attention kernel)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        features = model.image_features(x)
        if features.requires_grad:  # what the language model's backward sends into the features
            features.backward(torch.randn_like(features))
    assert counter.get_total_flops() == vision_flops(cfg, 2) + projector_flops(cfg, 2)
    total = num_floating_point_operations(cfg, 4, 50, images_per_sample=1)
    lm = transformer_flops(cfg.language, 4, 50)
    if "language" in frozen:
        c = cfg.language
        attention = 6 * 4 * 50 * 50 * c.num_layers * c.num_attention_heads * c.kv_channels
        lm = (lm - attention) * 4 / 6 + attention
    assert total == pytest.approx(lm + vision_flops(cfg, 4) + projector_flops(cfg, 4), rel=1e-12)


def test_config_round_trips_through_a_dict():
    cfg = llava_config(vision_feature_layer=[0, -1])
    assert LlavaConfig(**cfg.to_dict()) == cfg


@pytest.mark.parametrize("build, message", [
    (lambda: vision_config(img_h=18), r"--img-h \(18\) must be a multiple of --patch-dim \(4\)"),
    (lambda: vision_config(vision_model_type="siglip"), "--vision-model-type must be clip"),
    (lambda: vision_config(activation="relu"), "vision activation must be quick_gelu or gelu"),
    (lambda: vision_config(swiglu=True), "--swiglu"),
    (lambda: vision_config(max_position_embeddings=5), "vision max_position_embeddings"),
    (lambda: llava_config(vision={"add_class_token": False}), "vision_feature_select_strategy 'default'"),
    (lambda: llava_config(vision_feature_layer=4), "vision_feature_layer 4 is out of range"),
    (lambda: llava_config(vision_feature_layer=[]), "vision_feature_layer must be"),
    (lambda: llava_config(projector_type="conv"), "projector type must be mlp or affine"),
    (lambda: llava_config(pad_token_id=IMAGE), "image_token_id and pad_token_id must differ"),
])
def test_bad_configs_name_the_field(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_the_attention_probe_reads_the_language_models_attention():
    """On CUDA the parallel code probes the model's attention kernels from its config
    (runtime/attention_backends.py); a LLaVA config answers with its language model's shape."""
    from megatrain.runtime.attention_backends import AttentionCase

    cfg = llava_config()
    case = AttentionCase.from_config(cfg, torch.bfloat16)
    assert (case.head_dim, case.heads_per_group) == (cfg.language.head_dim, cfg.language.heads_per_group)
