"""Hugging Face export/import: same logits as transformers' own classes, lossless round trips,
token-for-token greedy generation, tokenizer files, and refusals of what cannot convert exactly."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from megatrain.convert.export_hf import export_checkpoint  # noqa: E402
from megatrain.models.common.hf_adapter import UnsupportedModelError  # noqa: E402
from megatrain.models.gpt.hf import gpt_config_from_hf, hf_architecture  # noqa: E402
from megatrain.convert.import_hf import import_hf_model  # noqa: E402
from megatrain.inference.generation import generate  # noqa: E402
from megatrain.inference.loading import load_model  # noqa: E402
from megatrain.models.gpt.config import GPTConfig  # noqa: E402
from megatrain.models.gpt import GPTModel  # noqa: E402
from megatrain import checkpoint as checkpointing  # noqa: E402
from megatrain.checkpoint import TrainState  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GPT2_FILES = REPO / ".." / "shared" / "data" / "gpt2"
VOCAB = 96

STYLES = {
    "gpt2": dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64),
    "gpt2_tanh_gelu": dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                           max_position_embeddings=64, gelu_approximation="tanh"),  # exported as "gelu_new"
    "gpt2_untied_nobias": dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                               max_position_embeddings=64, ffn_hidden_size=40, add_bias_linear=False,
                               untie_embeddings_and_output_weights=True),
    "llama": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=12,
                  vocab_size=VOCAB, ffn_hidden_size=48, position_embedding_type="rope", rotary_base=5000.0,
                  normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True, max_position_embeddings=128),
    "llama_tied_bias": dict(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=VOCAB, ffn_hidden_size=24,
                            position_embedding_type="rope", normalization="RMSNorm", swiglu=True),
    # --apply-layernorm-1p: the exported norm weights are 1 + ours
    "gpt2_layernorm_1p": dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                              max_position_embeddings=64, apply_layernorm_1p=True),
    "llama_layernorm_1p": dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               vocab_size=VOCAB, ffn_hidden_size=48, position_embedding_type="rope",
                               normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                               untie_embeddings_and_output_weights=True, apply_layernorm_1p=True),
    # GPT-2 always has biases: --add-qkv-bias alone exports with the other biases zero
    "gpt2_qkv_bias_only": dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                               max_position_embeddings=64, add_bias_linear=False, add_qkv_bias=True),
    # --disable-bias-linear --add-qkv-bias: Qwen2 (tied, as Qwen2-0.5B; a padded vocabulary never leaks)
    "qwen2": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
                  ffn_hidden_size=48, position_embedding_type="rope", rotary_base=1e6, normalization="RMSNorm",
                  swiglu=True, add_bias_linear=False, add_qkv_bias=True, max_position_embeddings=128),
    "qwen2_untied_kv_channels": dict(num_layers=1, hidden_size=32, num_attention_heads=4, kv_channels=12,
                                     vocab_size=VOCAB, ffn_hidden_size=40, position_embedding_type="rope",
                                     normalization="RMSNorm", swiglu=True, add_bias_linear=False, add_qkv_bias=True,
                                     untie_embeddings_and_output_weights=True),
    # --qk-layernorm with a head dim independent of hidden / heads (--kv-channels): Qwen3
    "qwen3": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                  vocab_size=VOCAB, ffn_hidden_size=48, position_embedding_type="rope", normalization="RMSNorm",
                  swiglu=True, add_bias_linear=False, qk_layernorm=True, max_position_embeddings=128),
    "qwen3_untied_layernorm_1p": dict(num_layers=1, hidden_size=32, num_attention_heads=2, kv_channels=24,
                                      vocab_size=VOCAB, ffn_hidden_size=40, position_embedding_type="rope",
                                      normalization="RMSNorm", swiglu=True, add_bias_linear=False, qk_layernorm=True,
                                      untie_embeddings_and_output_weights=True, apply_layernorm_1p=True),
    # --window-size 5,0 (sequences of 17 tokens and more: the window matters): Mistral's sliding_window 6,
    # or Qwen's with every layer sliding
    "mistral_window": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=1, vocab_size=VOCAB,
                           ffn_hidden_size=48, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                           add_bias_linear=False, untie_embeddings_and_output_weights=True, window_size=(5, 0)),
    "qwen2_window": dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, ffn_hidden_size=40,
                         position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                         add_qkv_bias=True, window_size=(3, 0)),
    "qwen3_window": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                         vocab_size=VOCAB, ffn_hidden_size=40, position_embedding_type="rope", normalization="RMSNorm",
                         swiglu=True, add_bias_linear=False, qk_layernorm=True, window_size=(7, -1)),
}
EXPORTED_AS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}


def random_model(style: str) -> GPTModel:
    """A model whose every parameter (norms and biases included) is random, so no mapping hides."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**STYLES[style]))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def save(model: GPTModel, path: Path, args: argparse.Namespace | None = None) -> Path:
    checkpointing.save_checkpoint(str(path), TrainState(iteration=5), model, None, {}, args or argparse.Namespace(),
                                  model.config)
    return path


def hf_load(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("style", list(STYLES))
def test_export_logits_and_greedy_generation_match(style, tmp_path):
    model = random_model(style)
    export_checkpoint(str(save(model, tmp_path / "ckpt")), str(tmp_path / "hf"), progress=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [EXPORTED_AS[style.split("_")[0]]]
    hf = hf_load(tmp_path / "hf")
    tokens = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < 1e-4
    with torch.no_grad():
        theirs = hf.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=10, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert generate(model, tokens.tolist(), 10) == theirs[:, tokens.shape[1]:].tolist()


def test_export_dtype_and_sharding(tmp_path):
    model = random_model("llama")
    export_checkpoint(str(save(model, tmp_path / "ckpt")), str(tmp_path / "hf"), dtype="bf16",
                      max_shard_size="8KB", progress=False)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (tmp_path / "hf" / "model.safetensors").exists()
    tensors = {k: v for s in shards for k, v in load_file(str(tmp_path / "hf" / s)).items()}
    assert set(tensors) == set(index["weight_map"]) and all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    hf = hf_load(tmp_path / "hf")  # loads the shards; bf16 weights, so compare loosely
    tokens = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 0.1


def _hf_gpt2_folder(path: Path, safe: bool, activation: str = "gelu") -> "transformers.PreTrainedModel":
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=48, vocab_size=90,
                                  activation_function=activation, tie_word_embeddings=True)
    torch.manual_seed(3)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(path))
    if not safe:  # the original GPT-2 release: pytorch_model.bin, no "transformer." prefix, mask buffers
        weights = {k.removeprefix("transformer."): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        weights["h.0.attn.bias"] = torch.ones(1, 1, 48, 48).tril()
        (path / "model.safetensors").unlink()
        torch.save(weights, path / "pytorch_model.bin")
    return model


def _hf_llama_folder(path: Path) -> "transformers.PreTrainedModel":
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
                                   intermediate_size=40, vocab_size=100, max_position_embeddings=64,
                                   rope_theta=500.0, tie_word_embeddings=False)
    torch.manual_seed(4)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(path))
    return model


# Tiny random models of the LLaMA-like classes, as their configs describe them (transformers' own classes).
LLAMA_LIKE_SOURCES = {
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        intermediate_size=40, vocab_size=100, max_position_embeddings=64, sliding_window=None,
        rope_theta=1e4, tie_word_embeddings=False)),
    "mistral_sliding_window": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
        vocab_size=100, max_position_embeddings=64, sliding_window=4)),
    "qwen2_sliding_window": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
        vocab_size=100, max_position_embeddings=64, use_sliding_window=True, sliding_window=5, max_window_layers=0)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
        vocab_size=100, max_position_embeddings=64, rope_theta=1e6, tie_word_embeddings=True)),
    "qwen2_untied": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=40,
        vocab_size=100, max_position_embeddings=64, tie_word_embeddings=False)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=40, vocab_size=100, max_position_embeddings=64, rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3_untied": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=24,
        intermediate_size=40, vocab_size=100, max_position_embeddings=64, tie_word_embeddings=False)),
}


def _hf_llama_like_folder(path: Path, source: str) -> "transformers.PreTrainedModel":
    torch.manual_seed(5)
    model = LLAMA_LIKE_SOURCES[source]().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("source", ["gpt2_bin", "gpt2_safetensors", "gpt2_gelu_new", "gpt2_gelu_pytorch_tanh", "llama",
                                    *LLAMA_LIKE_SOURCES])
def test_import_matches_hf_and_round_trip_is_lossless(source, tmp_path):
    src = tmp_path / "src"
    activation = source.removeprefix("gpt2_") if "gelu" in source else "gelu"
    hf = (_hf_llama_folder(src) if source == "llama"
          else _hf_llama_like_folder(src, source) if source in LLAMA_LIKE_SOURCES
          else _hf_gpt2_folder(src, safe=source != "gpt2_bin", activation=activation))
    ckpt = import_hf_model(str(src), str(tmp_path / "ckpt"))
    model, meta = load_model(str(tmp_path / "ckpt"), torch.device("cpu"))
    assert model.config.vocab_size == 128 and meta["args"]["hf_vocab_size"] == hf.config.vocab_size
    tokens = torch.randint(0, hf.config.vocab_size, (2, 11))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    assert (ours[..., : hf.config.vocab_size] - theirs).abs().max().item() < 1e-4
    assert os.path.basename(ckpt) == "iter_0000000"
    if source in LLAMA_LIKE_SOURCES:  # the printed flags rebuild exactly this model
        from megatrain.models.gpt.config import gpt_config_from_args
        from megatrain.training.arguments import parse_args
        args = parse_args([*meta["args"]["pretrain_flags"], "--seq-length", "16", "--micro-batch-size", "1",
                           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                           "--train-iters", "1", "--lr", "1e-3"])
        assert gpt_config_from_args(args, model.config.vocab_size) == model.config
    if source in LLAMA_LIKE_SOURCES:  # greedy generation token for token
        with torch.no_grad():
            expected = hf.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=8, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
        assert generate(model, tokens.tolist(), 8) == expected[:, tokens.shape[1]:].tolist()

    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    original = {k: v for k, v in hf.state_dict().items() if not k.endswith(".attn.bias")}
    if hf.config.tie_word_embeddings:
        original.pop("lm_head.weight")
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original)
    for k, v in original.items():
        assert torch.equal(back[k], v), k
    before = json.loads((src / "config.json").read_text())
    after = json.loads((tmp_path / "back" / "config.json").read_text())
    for key in ("architectures", "model_type", "vocab_size", "tie_word_embeddings", "n_layer", "n_embd", "n_head",
                "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings", "n_positions"):
        assert before.get(key) == after.get(key), key
    if source.startswith("gpt2"):  # the tanh approximation's three names export as one
        assert after["activation_function"] == ("gelu" if activation == "gelu" else "gelu_new")
        assert ("--no-bias-gelu-fusion" in meta["args"]["pretrain_flags"]) == (activation == "gelu")


def test_refusals(tmp_path):
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel needs.*LlamaForCausalLM needs"):
        hf_architecture(GPTConfig(position_embedding_type="rope", normalization="LayerNorm"))
    with pytest.raises(UnsupportedModelError, match="grouped-query"):
        hf_architecture(GPTConfig(num_query_groups=2))
    with pytest.raises(UnsupportedModelError, match="--rotary-percent 1.0"):
        hf_architecture(GPTConfig(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                                  rotary_percent=0.5))
    llama = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 32,
             "num_attention_heads": 4, "intermediate_size": 40, "vocab_size": 100}
    with pytest.raises(UnsupportedModelError, match="rope scaling 'llama3'"):
        gpt_config_from_hf({**llama, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 128)
    with pytest.raises(UnsupportedModelError, match="rope scaling 'linear'"):
        gpt_config_from_hf({**llama, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, 128)
    with pytest.raises(UnsupportedModelError, match="one switch for all linear biases"):
        gpt_config_from_hf({**llama, "attention_bias": True, "mlp_bias": False}, 128)
    with pytest.raises(UnsupportedModelError, match="not supported; supported: GPT2LMHeadModel"):
        gpt_config_from_hf({**llama, "architectures": ["GPTNeoXForCausalLM"]}, 128)
    # Mistral, Qwen2, Qwen3: what they add that megatrain lacks is refused, naming the config.json field.
    mistral = {**llama, "architectures": ["MistralForCausalLM"], "max_position_embeddings": 64}
    assert gpt_config_from_hf({**mistral, "sliding_window": 16}, 128)[0].window_size == (15, 0)  # 16 keys: 15 + itself
    cfg, arch = gpt_config_from_hf({**mistral, "sliding_window": None}, 128)
    assert arch == "MistralForCausalLM" and cfg.window_size is None and not cfg.add_bias_linear
    with pytest.raises(UnsupportedModelError, match="field sliding_window: expected a positive integer"):
        gpt_config_from_hf({**mistral, "sliding_window": 0}, 128)
    qwen2 = {**llama, "architectures": ["Qwen2ForCausalLM"]}
    cfg, _ = gpt_config_from_hf(qwen2, 128)
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and cfg.window_size is None
    assert cfg.untie_embeddings_and_output_weights  # no tie_word_embeddings: Qwen2Config's default, untied
    assert gpt_config_from_hf({**qwen2, "sliding_window": 16}, 128)[0].window_size is None  # use_sliding_window off
    sliding = {**qwen2, "use_sliding_window": True, "sliding_window": 16}
    assert gpt_config_from_hf({**sliding, "max_window_layers": 0}, 128)[0].window_size == (15, 0)
    assert gpt_config_from_hf(sliding, 128)[0].window_size is None  # max_window_layers 28 (default): no layer slides
    with pytest.raises(UnsupportedModelError, match="field layer_types .*mixes full and sliding"):
        gpt_config_from_hf({**sliding, "num_hidden_layers": 30}, 128)  # layers 28 and 29 slide
    with pytest.raises(UnsupportedModelError, match="field layer_types .*mixes full and sliding"):
        gpt_config_from_hf({**sliding, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
                           128)
    assert gpt_config_from_hf({**qwen2, "num_hidden_layers": 2, "layer_types": ["sliding_attention"] * 2},
                              128)[0].window_size is None  # use_sliding_window false: transformers ignores them
    with pytest.raises(UnsupportedModelError, match="field layer_types holds \\['chunked_attention'\\]"):
        gpt_config_from_hf({**qwen2, "layer_types": ["chunked_attention"]}, 128)
    qwen3 = {**llama, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16}
    cfg, _ = gpt_config_from_hf(qwen3, 128)
    assert cfg.qk_layernorm and cfg.kv_channels == 16 and not cfg.add_qkv_bias and not cfg.add_bias_linear
    with pytest.raises(UnsupportedModelError, match="field attention_bias"):
        gpt_config_from_hf({**qwen3, "attention_bias": True}, 128)
    for source in (mistral, qwen2, qwen3):
        with pytest.raises(UnsupportedModelError, match="rope scaling 'yarn'"):
            gpt_config_from_hf({**source, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 128)
        with pytest.raises(UnsupportedModelError, match="field mlp_bias"):
            gpt_config_from_hf({**source, "mlp_bias": True}, 128)
    llama_style = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
    with pytest.raises(UnsupportedModelError, match="Qwen3ForCausalLM, which needs --disable-bias-linear"):
        hf_architecture(GPTConfig(**llama_style, qk_layernorm=True))
    with pytest.raises(UnsupportedModelError, match="no --qk-layernorm"):
        hf_architecture(GPTConfig(qk_layernorm=True))
    assert hf_architecture(GPTConfig(**llama_style, add_qkv_bias=True)) == "LlamaForCausalLM"  # biases anyway
    assert hf_architecture(GPTConfig(add_bias_linear=False, add_qkv_bias=True)) == "GPT2LMHeadModel"  # zero biases
    with pytest.raises(UnsupportedModelError, match="--window-size exports as MistralForCausalLM.*--disable-bias-linear"):
        hf_architecture(GPTConfig(**llama_style, window_size=(3, 0)))
    with pytest.raises(UnsupportedModelError, match="full attention \\(no --window-size\\)"):
        hf_architecture(GPTConfig(window_size=(3, 0)))
    assert hf_architecture(GPTConfig(**llama_style, add_bias_linear=False, window_size=(-1, 0))) == "LlamaForCausalLM"
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "n_layer": 1, "n_embd": 32, "n_head": 4, "vocab_size": 90}
    assert gpt_config_from_hf(gpt2, 128)[0].gelu_approximation == "tanh"  # GPT-2's default: gelu_new
    with pytest.raises(UnsupportedModelError, match="activation_function 'relu'.*exact GELU"):
        gpt_config_from_hf({**gpt2, "activation_function": "relu"}, 128)
    with pytest.raises(UnsupportedModelError, match="scale_attn_by_inverse_layer_idx"):
        gpt_config_from_hf({**gpt2, "activation_function": "gelu", "scale_attn_by_inverse_layer_idx": True}, 128)
    # The command line turns them into one error line, not a traceback.
    model = GPTModel(GPTConfig(position_embedding_type="rope", num_layers=1, hidden_size=16, num_attention_heads=2))
    save(model, tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint_to_hf.py"),
                           "--checkpoint-path", str(tmp_path / "ckpt"), "--output-path", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.startswith("error: this model has no exact Hugging Face equivalent")
    assert "Traceback" not in proc.stderr and not (tmp_path / "out" / "config.json").exists()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps({**llama, "rope_scaling": {"type": "dynamic"}}))
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert_hf_to_checkpoint.py"), "--hf-path",
                           str(tmp_path / "src"), "--save", str(tmp_path / "c2")], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 2 and "rope scaling 'dynamic' is not implemented" in proc.stderr


def test_gpt2_tokenizer_files_load_in_transformers(tmp_path):
    if not (GPT2_FILES / "gpt2-vocab.json").exists():
        pytest.skip("../shared/data/gpt2 is not available")
    args = argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=str(GPT2_FILES / "gpt2-vocab.json"),
                              merge_file=str(GPT2_FILES / "gpt2-merges.txt"))
    cfg = dict(STYLES["gpt2"], vocab_size=50304)
    model = GPTModel(GPTConfig(**cfg))
    export_checkpoint(str(save(model, tmp_path / "ckpt", args)), str(tmp_path / "hf"), progress=False)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert tok.eos_token_id == 50256 and tok.decode([15496, 995]) == "Hello world"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == 50256

    # Importing the exported folder gives the Megatron tokenizer flags back (copied into the checkpoint).
    import_hf_model(str(tmp_path / "hf"), str(tmp_path / "back"))
    meta = checkpointing.read_meta(checkpointing.find_checkpoint(str(tmp_path / "back")))
    assert meta["args"]["tokenizer_type"] == "GPT2BPETokenizer"
    assert Path(meta["args"]["vocab_file"]).read_bytes() == (GPT2_FILES / "gpt2-vocab.json").read_bytes()
    assert "--swiglu" not in meta["args"]["pretrain_flags"] and meta["model_config"]["vocab_size"] == 50304
