"""Llama 3.x RoPE scaling (Megatron's --use-rope-scaling / --rope-scaling-factor, Hugging Face's
``rope_type: "llama3"``): the frequency rule against its definition, the logits and greedy generation
of transformers' LlamaForCausalLM (beyond the original context, through the KV cache too), lossless
round trips, the flags and checkpoint checks, and refusals of every other scaling type."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from megatrain import checkpoint as checkpointing  # noqa: E402
from megatrain.convert.export_hf import export_checkpoint  # noqa: E402
from megatrain.convert.import_hf import import_hf_model  # noqa: E402
from megatrain.inference.generation import generate  # noqa: E402
from megatrain.inference.loading import load_model  # noqa: E402
from megatrain.models.common.attention import KVCache  # noqa: E402
from megatrain.models.common.hf_adapter import UnsupportedModelError  # noqa: E402
from megatrain.models.common.rope import rotary_inv_freq  # noqa: E402
from megatrain.models.gpt import GPTModel  # noqa: E402
from megatrain.models.gpt.config import GPTConfig, gpt_config_from_args  # noqa: E402
from megatrain.models.gpt.hf import gpt_config_from_hf, hf_architecture  # noqa: E402
from megatrain.training.arguments import parse_args  # noqa: E402
from tests.unit.test_hf_conversion import save  # noqa: E402

TRAIN_FLAGS = ["--seq-length", "16", "--micro-batch-size", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
               "--vocab-size", "100", "--train-iters", "1", "--lr", "1e-3"]


def reference_inv_freq(head_dim: int, base: float, factor: float, low: float, high: float, context: int) -> list[float]:
    """Llama 3.x scaling written out from its definition, one dimension pair at a time in float64:
    a wavelength above context / low is stretched by ``factor``, one below context / high is kept,
    and in between the frequency moves linearly (in context / wavelength) from f / factor to f."""
    out = []
    for i in range(0, head_dim, 2):
        f = base ** (-i / head_dim)
        wavelength = 2 * math.pi / f
        if wavelength < context / high:
            out.append(f)
        elif wavelength > context / low:
            out.append(f / factor)
        else:
            t = (context / wavelength - low) / (high - low)
            out.append((1 - t) * f / factor + t * f)
    return out


@pytest.mark.parametrize("head_dim, base, factor, low, high, context", [
    (128, 500000.0, 8.0, 1.0, 4.0, 8192),  # Llama 3.1
    (64, 500000.0, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B
    (16, 10000.0, 4.0, 1.0, 2.0, 24),  # the tiny models below
    (16, 100.0, 3.0, 2.0, 5.0, 40),
])
def test_llama3_frequencies_follow_the_definition_and_transformers(head_dim, base, factor, low, high, context):
    ours = rotary_inv_freq(head_dim, base, (factor, low, high, float(context)))
    expected = torch.tensor(reference_inv_freq(head_dim, base, factor, low, high, context), dtype=torch.float64)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=0)
    wavelengths = 2 * math.pi / rotary_inv_freq(head_dim, base)  # before scaling
    kept, stretched = wavelengths < context / high, wavelengths > context / low
    assert kept.any() and stretched.any() and (~kept & ~stretched).any()  # each case has all three regimes
    # bit for bit what transformers computes for rope_type llama3
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf = transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, max_position_embeddings=131072,
                                  rope_parameters={"rope_type": "llama3", "rope_theta": base, "factor": factor,
                                                   "low_freq_factor": low, "high_freq_factor": high,
                                                   "original_max_position_embeddings": context})
    assert torch.equal(ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")[0], ours)


def test_megatron_flags_and_defaults():
    """--use-rope-scaling --rope-scaling-factor as Megatron-LM (factor 8; low 1, high 4 and 8192 positions
    fixed there, megatrain's own flags here); without --use-rope-scaling the factor changes nothing."""
    shape = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--position-embedding-type",
             "rope", "--normalization", "RMSNorm", "--swiglu"]
    cfg = gpt_config_from_args(parse_args([*shape, *TRAIN_FLAGS, "--use-rope-scaling"]), 128)
    assert (cfg.use_rope_scaling, cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor,
            cfg.rope_scaling_high_freq_factor, cfg.rope_scaling_original_max_position_embeddings) == (
        True, 8.0, 1.0, 4.0, 8192)
    cfg = gpt_config_from_args(parse_args([*shape, *TRAIN_FLAGS, "--use-rope-scaling", "--rope-scaling-factor", "32",
                                           "--rope-scaling-high-freq-factor", "2",
                                           "--rope-scaling-original-max-position-embeddings", "24"]), 128)
    assert (cfg.rope_scaling_factor, cfg.rope_scaling_high_freq_factor,
            cfg.rope_scaling_original_max_position_embeddings) == (32.0, 2.0, 24)
    assert not gpt_config_from_args(parse_args([*shape, *TRAIN_FLAGS, "--rope-scaling-factor", "32"]),
                                    128).use_rope_scaling
    with pytest.raises(SystemExit, match="--use-rope-scaling .*needs --position-embedding-type rope"):
        parse_args([*shape[:6], *TRAIN_FLAGS, "--use-rope-scaling"])
    with pytest.raises(ValueError, match="--rope-scaling-low-freq-factor \\(4.0\\) must be positive and below"):
        GPTConfig(position_embedding_type="rope", use_rope_scaling=True, rope_scaling_low_freq_factor=4.0)


def test_checkpoint_comparison_and_use_checkpoint_args(tmp_path):
    scaled = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=128, ffn_hidden_size=40,
                       position_embedding_type="rope", normalization="RMSNorm", swiglu=True, use_rope_scaling=True,
                       rope_scaling_factor=4.0, rope_scaling_high_freq_factor=2.0,
                       rope_scaling_original_max_position_embeddings=24)
    saved = dict(scaled.__dict__)

    def diff(**changes):
        return checkpointing.config_differences(saved, GPTConfig(**{**scaled.__dict__, **changes}))

    assert diff(use_rope_scaling=False) == ["--use-rope-scaling: checkpoint with, flags without "
                                            "(Llama 3.x RoPE scaling)"]
    assert diff(rope_scaling_factor=8.0) == ["--rope-scaling-factor: checkpoint 4.0, flags 8.0"]
    assert diff(rope_scaling_original_max_position_embeddings=8192) == [
        "--rope-scaling-original-max-position-embeddings: checkpoint 24, flags 8192"]
    unscaled = {**saved, "use_rope_scaling": False}
    assert checkpointing.config_differences(unscaled, GPTConfig(**{**unscaled, "rope_scaling_factor": 2.0})) == []
    before = {k: v for k, v in unscaled.items() if not k.startswith(("use_rope", "rope_scaling"))}
    assert checkpointing.config_differences(before, GPTConfig(**unscaled)) == []  # a checkpoint from before them
    # --use-checkpoint-args takes them from the checkpoint
    path = save(GPTModel(scaled), tmp_path / "ckpt", argparse.Namespace(seq_length=16))
    args = parse_args(["--load", str(path), "--use-checkpoint-args", *TRAIN_FLAGS])
    assert gpt_config_from_args(args, 128) == scaled


def _hf_llama3_folder(path, tied: bool):
    """A tiny random LlamaForCausalLM with llama3 scaling over a short original context, so that the 40-token
    sequences below reach far past it: head dim 16, one pair kept, one in the band, six stretched (tied);
    default low/high factors over 16 positions (untied)."""
    scaling = (dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=2.0, original_max_position_embeddings=24) if tied
               else dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16))
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=40, vocab_size=100, max_position_embeddings=64,
                                   tie_word_embeddings=tied,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, **scaling})
    torch.manual_seed(6)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_llama3_import_matches_transformers_and_round_trips(tied, tmp_path):
    src = tmp_path / "src"
    hf = _hf_llama3_folder(src, tied)
    import_hf_model(str(src), str(tmp_path / "ckpt"))
    model, meta = load_model(str(tmp_path / "ckpt"), torch.device("cpu"))
    cfg = model.config
    assert cfg.use_rope_scaling and cfg.rope_scaling_original_max_position_embeddings == (24 if tied else 16)
    tokens = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens)[..., :100], hf(tokens).logits
        unscaled = GPTModel(GPTConfig(**{**cfg.__dict__, "use_rope_scaling": False}))
        unscaled.load_state_dict(model.state_dict())
        plain = unscaled.eval()(tokens)[..., :100]
    assert (ours - theirs).abs().max().item() < 1e-4
    assert (plain - theirs).abs().max().item() > 1e-2  # the scaling matters at these lengths

    # The printed flags rebuild exactly this model.
    args = parse_args([*meta["args"]["pretrain_flags"], *TRAIN_FLAGS])
    assert gpt_config_from_args(args, cfg.vocab_size) == cfg
    assert ("--rope-scaling-high-freq-factor" in meta["args"]["pretrain_flags"]) == tied

    if not tied:  # greedy generation token for token: a prompt inside the original 16 positions, decoded past them
        prompt = tokens[:, :6]
        with torch.no_grad():
            expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
        assert generate(model, prompt.tolist(), 20) == expected[:, 6:].tolist()

    else:  # the KV-cache path uses the scaled frequencies: 30 tokens prefilled, then one at a time past them
        cache = KVCache(max_length=40)
        with torch.no_grad():
            steps = [model(tokens[:, :30], kv_cache=cache)] + [
                model(tokens[:, i:i + 1], position_ids=torch.tensor([[i]]), kv_cache=cache) for i in range(30, 40)]
        assert (torch.cat(steps, dim=1)[..., :100] - ours).abs().max().item() < 1e-4

    # Back to Hugging Face: the same tensors bit for bit and the same RoPE fields.
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    original = dict(hf.state_dict())
    if tied:
        original.pop("lm_head.weight")
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original) and all(torch.equal(back[k], v) for k, v in original.items())
    before = json.loads((src / "config.json").read_text())
    after = json.loads((tmp_path / "back" / "config.json").read_text())
    assert after["rope_parameters"] == before["rope_parameters"]
    assert after["rope_scaling"] == {k: v for k, v in before["rope_parameters"].items() if k != "rope_theta"}
    for key in ("architectures", "tie_word_embeddings", "max_position_embeddings", "num_key_value_heads"):
        assert after[key] == before[key], key
    reread = transformers.AutoConfig.from_pretrained(str(tmp_path / "back"))
    assert reread.rope_parameters == hf.config.rope_parameters


def test_transformers_4_style_config_imports_the_same():
    """Meta's Llama 3.x files: ``rope_scaling`` with ``rope_theta`` beside it (transformers 4's keys)."""
    llama = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 32,
             "num_attention_heads": 4, "intermediate_size": 40, "vocab_size": 100, "max_position_embeddings": 131072}
    scaling = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    old, _ = gpt_config_from_hf({**llama, "rope_theta": 500000.0, "rope_scaling": scaling}, 128)
    new, _ = gpt_config_from_hf({**llama, "rope_parameters": {**scaling, "rope_theta": 500000.0}}, 128)
    assert old == new and new.use_rope_scaling and new.rotary_base == 500000.0 and new.rope_scaling_factor == 32.0
    # no original_max_position_embeddings: transformers takes max_position_embeddings
    short = {k: v for k, v in scaling.items() if k != "original_max_position_embeddings"}
    assert gpt_config_from_hf({**llama, "rope_scaling": short}, 128)[0].rope_scaling_original_max_position_embeddings \
        == 131072
    # rope_scaling is what transformers reads when both are given
    assert gpt_config_from_hf({**llama, "rope_scaling": scaling, "rope_parameters": {"rope_type": "default"}},
                              128)[0].use_rope_scaling


def test_other_scaling_types_and_classes_are_refused():
    llama = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 32,
             "num_attention_heads": 4, "intermediate_size": 40, "vocab_size": 100}
    for kind in ("linear", "dynamic", "yarn", "longrope"):
        for key in ("rope_scaling", "rope_parameters"):
            with pytest.raises(UnsupportedModelError, match=f"field {key}: rope scaling '{kind}' is not implemented"):
                gpt_config_from_hf({**llama, key: {"rope_type": kind, "factor": 4.0}}, 128)
    with pytest.raises(UnsupportedModelError, match="rope scaling 'dynamic'"):
        gpt_config_from_hf({**llama, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, 128)  # the old key name
    with pytest.raises(UnsupportedModelError, match="'llama3' needs low_freq_factor, high_freq_factor"):
        gpt_config_from_hf({**llama, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 128)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    for arch in ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        with pytest.raises(UnsupportedModelError, match=f"'llama3' is supported for LlamaForCausalLM only, not {arch}"):
            gpt_config_from_hf({**llama, "architectures": [arch], "rope_parameters": llama3}, 128)
    llama_style = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, use_rope_scaling=True)
    assert hf_architecture(GPTConfig(**llama_style)) == "LlamaForCausalLM"
    with pytest.raises(UnsupportedModelError, match="--use-rope-scaling .*exports as LlamaForCausalLM only; .*Qwen3"):
        hf_architecture(GPTConfig(**llama_style, add_bias_linear=False, qk_layernorm=True))
