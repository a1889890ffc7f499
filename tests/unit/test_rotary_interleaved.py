"""Interleaved RoPE (Megatron's --rotary-interleaved): the rotation against its definition written out
pair by pair (with --rotary-percent below 1 too), the half layout unchanged, a model's forward with and
without the KV cache, the flag and the checkpoint comparison, and the Hugging Face export (half layout,
q/k rows reordered per head) against transformers' logits."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatrain import checkpoint as checkpointing
from megatrain.models.common.attention import KVCache
from megatrain.models.common.rope import apply_rotary, rotary_cos_sin
from megatrain.models.gpt import GPTModel
from megatrain.models.gpt.config import GPTConfig, gpt_config_from_args
from megatrain.training.arguments import parse_args

TRAIN_FLAGS = ["--seq-length", "16", "--micro-batch-size", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
               "--vocab-size", "96", "--train-iters", "1", "--lr", "1e-3", "--position-embedding-type", "rope",
               "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2"]


def reference_interleaved(x: torch.Tensor, positions: list[int], rotary_dim: int, base: float) -> torch.Tensor:
    """x [b, heads, s, d]: dims (2i, 2i + 1), i < rotary_dim / 2, rotated by position * base ** (-2i / r),
    one pair at a time in float64; the dims from rotary_dim on unchanged."""
    out = x.double().clone()
    for t, pos in enumerate(positions):
        for i in range(rotary_dim // 2):
            angle = pos * base ** (-2 * i / rotary_dim)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[..., t, 2 * i].double(), x[..., t, 2 * i + 1].double()
            out[..., t, 2 * i] = a * c - b * s
            out[..., t, 2 * i + 1] = b * c + a * s
    return out


@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 16), (16, 8), (12, 6)])
def test_rotation_matches_pairwise_definition(head_dim, rotary_dim):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, head_dim)
    positions = [0, 1, 2, 5, 9, 30, 100]
    cos, sin = rotary_cos_sin(torch.tensor([positions]), rotary_dim, 10000.0, interleaved=True)
    ours = apply_rotary(x, cos, sin, interleaved=True)
    torch.testing.assert_close(ours.double(), reference_interleaved(x, positions, rotary_dim, 10000.0),
                               atol=1e-5, rtol=1e-5)
    # the half layout is the same rotation with the dims permuted: pair (2i, 2i + 1) -> (i, i + r/2)
    order = torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                       torch.arange(rotary_dim, head_dim)))
    cos_h, sin_h = rotary_cos_sin(torch.tensor([positions]), rotary_dim, 10000.0)
    torch.testing.assert_close(apply_rotary(x[..., order], cos_h, sin_h), ours[..., order])


def test_half_layout_tables_unchanged():
    positions = torch.arange(11).unsqueeze(0)
    cos, sin = rotary_cos_sin(positions, 8, 500.0)
    angles = positions.float().unsqueeze(-1) * (1.0 / 500.0 ** (torch.arange(0, 8, 2).float() / 8))
    assert torch.equal(cos, torch.cat((angles, angles), -1).cos()) and torch.equal(sin, torch.cat((angles, angles),
                                                                                                  -1).sin())
    cos_i, _ = rotary_cos_sin(positions, 8, 500.0, interleaved=True)
    assert torch.equal(cos_i, angles.repeat_interleave(2, -1).cos())


def llama(**overrides) -> GPTConfig:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=12,
                  vocab_size=96, ffn_hidden_size=48, position_embedding_type="rope", rotary_base=5000.0,
                  normalization="RMSNorm", swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
                  max_position_embeddings=128, rotary_interleaved=True)
    fields.update(overrides)
    return GPTConfig(**fields)


def random_model(cfg: GPTConfig) -> GPTModel:
    torch.manual_seed(0)
    model = GPTModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_forward_with_and_without_kv_cache(rotary_percent):
    model = random_model(llama(rotary_percent=rotary_percent))
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(12)
        steps = [model(tokens[:, :5], kv_cache=cache)] + [model(tokens[:, t:t + 1], kv_cache=cache)
                                                          for t in range(5, 12)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full)
        half = GPTModel(llama(rotary_percent=rotary_percent, rotary_interleaved=False)).eval()
        half.load_state_dict(model.state_dict())
        assert (half(tokens) - full).abs().max().item() > 1e-3  # the layout matters


def test_flag_config_and_checkpoint_comparison():
    assert gpt_config_from_args(parse_args(TRAIN_FLAGS), 96).rotary_interleaved is False
    cfg = gpt_config_from_args(parse_args([*TRAIN_FLAGS, "--rotary-interleaved"]), 96)
    assert cfg.rotary_interleaved is True
    with pytest.raises(ValueError, match="--rotary-interleaved .* needs --position-embedding-type rope"):
        GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, rotary_interleaved=True)
    saved = dict(cfg.__dict__)
    assert checkpointing.config_differences(saved, GPTConfig(**{**saved, "rotary_interleaved": False})) == [
        "--rotary-interleaved: checkpoint with, flags without (which dims RoPE pairs: another layout of the q/k "
        "weights)"]
    before = {k: v for k, v in saved.items() if k != "rotary_interleaved"}  # a checkpoint from before the field
    assert checkpointing.config_differences(before, GPTConfig(**{**saved, "rotary_interleaved": False})) == []
    assert checkpointing.config_differences(before, cfg) != []


@pytest.mark.parametrize("overrides, architecture", [
    ({}, "LlamaForCausalLM"), (dict(add_qkv_bias=True), "Qwen2ForCausalLM"),  # q/k biases reordered too
    (dict(qk_layernorm=True, kv_channels=16), "Qwen3ForCausalLM"),  # and the q/k norm weights
], ids=["llama", "qwen2", "qwen3"])
def test_export_matches_transformers(overrides, architecture, tmp_path):
    transformers = pytest.importorskip("transformers")
    from megatrain.convert.export_hf import export_checkpoint
    from tests.unit.test_hf_conversion import save

    model = random_model(llama(**overrides))
    export_checkpoint(str(save(model, tmp_path / "ckpt")), str(tmp_path / "hf"), progress=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [architecture]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-4
