"""The HF import streams: shards are read one tensor at a time, converted one layer at a time, and the
checkpoint written holds the same numbers as converting the whole state dict at once."""

from __future__ import annotations

import json
import os
import weakref

import torch
from safetensors.torch import save_file

from megatrain.checkpoint import find_checkpoint, read_meta
from megatrain.checkpoint import checkpoint_model_config
from megatrain.convert.export_hf import load_full_state_dict
from megatrain.convert.import_hf import HFWeights, import_hf_model, read_hf_config
from megatrain.convert.streaming import StreamingConversion, tensor_group
from megatrain.models.registry import family_for_hf

LAYERS, HIDDEN, FFN, VOCAB = 4, 64, 160, 256


def _llama_folder(path: str) -> None:
    """A random bf16 Llama in three shards."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": rand(HIDDEN),
               "lm_head.weight": rand(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        q = f"model.layers.{i}."
        tensors.update({q + "input_layernorm.weight": rand(HIDDEN),
                        q + "post_attention_layernorm.weight": rand(HIDDEN),
                        q + "self_attn.q_proj.weight": rand(HIDDEN, HIDDEN),
                        q + "self_attn.k_proj.weight": rand(HIDDEN // 2, HIDDEN),
                        q + "self_attn.v_proj.weight": rand(HIDDEN // 2, HIDDEN),
                        q + "self_attn.o_proj.weight": rand(HIDDEN, HIDDEN), q + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
                        q + "mlp.up_proj.weight": rand(FFN, HIDDEN), q + "mlp.down_proj.weight": rand(HIDDEN, FFN)})
    os.makedirs(path)
    names = sorted(tensors)
    weight_map = {}
    for n, part in enumerate((names[:10], names[10:25], names[25:])):
        fname = f"model-{n + 1:05d}-of-00003.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(path, fname))
        weight_map.update({k: fname for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
                   "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 128,
                   "rms_norm_eps": 1e-5, "tie_word_embeddings": False}, f)


def test_conversion_holds_one_layer_and_matches_the_whole_state_dict(tmp_path):
    src = str(tmp_path / "hf")
    _llama_folder(src)
    hf_config = read_hf_config(src)
    family = family_for_hf(hf_config)
    cfg, arch = family.hf.config_from_hf(hf_config, VOCAB)
    weights = HFWeights(src)

    def convert(hf):
        return family.hf.from_hf_state_dict(hf, cfg, arch)

    expected = convert({k: weights.tensor(k).float() for k in weights.names})

    alive: set[str] = set()
    most = 0

    def read(name: str) -> torch.Tensor:
        nonlocal most
        t = weights.tensor(name)
        alive.add(name)
        weakref.finalize(t, alive.discard, name)
        most = max(most, len(alive))
        return t

    conversion = StreamingConversion(weights.shapes, read, convert, cast=torch.float32)
    assert set(conversion.outputs) == set(expected) and all(t.is_meta for t in conversion.outputs.values())
    for name in expected:  # the order a checkpoint is written in
        got = conversion.get(name)
        assert got.dtype == expected[name].dtype and torch.equal(got, expected[name]), name
        del got
    biggest_group = max(sum(1 for n in weights.names if tensor_group(n) == g) for g in map(tensor_group, weights.names))
    assert most <= biggest_group, f"{most} source tensors held at once; one group has at most {biggest_group}"

    ckpt = import_hf_model(src, str(tmp_path / "ckpt"), make_vocab_size_divisible_by=1, progress=False)
    ckpt = find_checkpoint(ckpt, None) or ckpt
    saved = load_full_state_dict(ckpt, checkpoint_model_config(ckpt, read_meta(ckpt)), family)
    assert set(saved) == set(expected)
    for name, t in expected.items():
        assert torch.equal(saved[name], t), name
