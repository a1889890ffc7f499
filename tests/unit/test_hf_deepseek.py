"""Hugging Face conversion of DeepseekV3ForCausalLM: multi-latent attention (with and without the query
bottleneck), YaRN RoPE, and DeepSeek's MoE (sigmoid scores, expert-bias-corrected group-limited top-k,
routed scaling, a shared expert, dense first layers), both ways.

Tiny random models built by transformers import with its logits (fp32, < 1e-4) and greedy generations;
exporting gives the same tensors back bit for bit; megatrain MLA models export and transformers loads
them with the same logits; what cannot convert exactly is refused in one line."""

from __future__ import annotations

import argparse

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("megatrain.models.common.mla")

from safetensors.torch import load_file  # noqa: E402

from megatrain import checkpoint as checkpointing  # noqa: E402
from megatrain.checkpoint import TrainState  # noqa: E402
from megatrain.convert.export_hf import export_checkpoint  # noqa: E402
from megatrain.convert.import_hf import import_hf_model  # noqa: E402
from megatrain.inference.generation import generate  # noqa: E402
from megatrain.inference.loading import load_model  # noqa: E402
from megatrain.models.common.hf_adapter import UnsupportedModelError  # noqa: E402
from megatrain.models.gpt import GPTModel  # noqa: E402
from megatrain.models.gpt.config import GPTConfig, gpt_config_from_args  # noqa: E402
from megatrain.models.gpt.hf import gpt_config_from_hf, hf_architecture  # noqa: E402
from tests.unit.test_hf_moe import _noisy, hf_greedy, hf_load, max_diff, tokens  # noqa: E402

VOCAB = 100
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
HF_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
                kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=64)
# top-4 from 2 of 4 groups: each group ranked by its top 4 / 2 = 2 scores on both sides (transformers always
# sums a group's top 2; a top-2 from 2 groups would be ranked by the top 1 in Megatron, refused below)
MOE = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
           topk_group=2, n_shared_experts=1, moe_intermediate_size=16, routed_scaling_factor=2.5)

HF_SOURCES = {
    # the query bottleneck, YaRN, MoE from layer 1 on, random expert biases
    "moe_q_lora": dict(q_lora_rank=24, tie_word_embeddings=False, rope_parameters=YARN, **MOE),
    # queries straight from hidden (q_proj, no q norm), tied embeddings
    "moe_no_q_lora": dict(q_lora_rank=None, tie_word_embeddings=True, rope_parameters=YARN, **MOE),
    # every layer dense, plain RoPE
    "dense_rope": dict(q_lora_rank=24, num_hidden_layers=2, first_k_dense_replace=2, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
}


def hf_model(source: str):
    torch.manual_seed(5)
    config = transformers.DeepseekV3Config(**HF_SHAPE, **HF_SOURCES[source])
    model = _noisy(transformers.DeepseekV3ForCausalLM(config), 6)
    with torch.no_grad():  # a buffer: _noisy leaves it at zero
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    return model


@pytest.mark.parametrize("source", list(HF_SOURCES))
def test_import_matches_transformers_and_round_trip_is_exact(source, tmp_path):
    hf = hf_model(source)
    hf.save_pretrained(str(tmp_path / "src"))
    import_hf_model(str(tmp_path / "src"), str(tmp_path / "ckpt"), progress=False)
    model, meta = load_model(str(tmp_path / "ckpt"), torch.device("cpu"))
    cfg = model.config
    assert meta["args"]["hf_architecture"] == "DeepseekV3ForCausalLM"
    assert cfg.multi_latent_attention and cfg.q_lora_rank == hf.config.q_lora_rank
    if source.startswith("moe"):
        assert cfg.moe_layer_freq == [0, 1, 1] and cfg.moe_router_score_function == "sigmoid"
        assert cfg.moe_router_num_groups == 4 and cfg.moe_router_group_topk == 2
        assert cfg.moe_router_topk_scaling_factor == 2.5 and cfg.moe_shared_expert_intermediate_size == 16
    else:
        assert cfg.num_moe_experts is None and cfg.rope_type == "rope" and cfg.rotary_base == 5000.0
    ids = tokens()
    with torch.no_grad():
        assert max_diff(model(ids), hf(ids).logits) < 1e-4
    assert generate(model, ids.tolist(), 6) == hf_greedy(hf, ids, 6)

    # the printed flags rebuild exactly this model
    from megatrain.training.arguments import parse_args
    args = parse_args([*meta["args"]["pretrain_flags"], "--seq-length", "16", "--micro-batch-size", "1",
                       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
                       "--train-iters", "1", "--lr", "1e-3"])
    assert gpt_config_from_args(args, cfg.vocab_size) == cfg

    # export: transformers' own files back, bit for bit, and the same effective config
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    original = load_file(str(tmp_path / "src" / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original)
    for k, v in original.items():
        assert torch.equal(back[k], v), k
    again = hf_load(tmp_path / "back")
    before, after = hf.config.to_dict(), again.config.to_dict()
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "first_k_dense_replace", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                "n_shared_experts", "moe_intermediate_size", "routed_scaling_factor", "norm_topk_prob",
                "tie_word_embeddings", "rope_parameters", "rope_interleave", "rms_norm_eps", "intermediate_size"):
        if source.startswith("moe") or key in ("q_lora_rank", "rope_parameters", "first_k_dense_replace"):
            assert before.get(key) == after.get(key), key
    with torch.no_grad():
        assert max_diff(model(ids), again(ids).logits) < 1e-4


MT_SHAPE = dict(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=128, ffn_hidden_size=96,
                max_position_embeddings=64, multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=12,
                qk_pos_emb_head_dim=8, v_head_dim=10, qk_layernorm=True, normalization="RMSNorm", norm_epsilon=1e-6,
                swiglu=True, add_bias_linear=False, position_embedding_type="rope", hidden_dropout=0.0,
                attention_dropout=0.0, untie_embeddings_and_output_weights=True)
MT_YARN = dict(rope_type="yarn", rotary_scaling_factor=40.0, mscale=0.707, mscale_all_dim=0.707,
               yarn_original_max_position_embeddings=16)
MT_MOE = dict(num_moe_experts=8, moe_router_topk=4, moe_ffn_hidden_size=16, moe_router_score_function="sigmoid",
              moe_router_enable_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
              moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1, 1])
STYLES = {
    "moe": dict(q_lora_rank=24, **MT_YARN, **MT_MOE),
    # no expert bias (zeros in the export), no group limit (n_group 1), top-1 (no renormalisation)
    "moe_plain_router": dict(**MT_YARN, **{**MT_MOE, "moe_router_enable_expert_bias": False,
                                           "moe_router_num_groups": None, "moe_router_group_topk": None,
                                           "moe_router_topk": 1, "moe_router_topk_scaling_factor": None}),
    # dense, YaRN with mscale 1 and mscale_all_dim 0 (transformers' other branch, the same numbers)
    "dense": dict(q_lora_rank=24, rope_type="yarn", rotary_scaling_factor=4.0,
                  yarn_original_max_position_embeddings=16),
}


@pytest.mark.parametrize("style", list(STYLES))
def test_export_of_a_megatrain_mla_model(style, tmp_path):
    torch.manual_seed(0)
    model = _noisy(GPTModel(GPTConfig(**MT_SHAPE, **STYLES[style])), 1)
    if model.config.moe_router_enable_expert_bias:
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.3)
    checkpointing.save_checkpoint(str(tmp_path / "ckpt"), TrainState(iteration=3), model, None, {},
                                  argparse.Namespace(), model.config)
    config = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "hf"), progress=False)
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    hf = hf_load(tmp_path / "hf")
    moe = [type(layer.mlp).__name__ == "DeepseekV3MoE" for layer in hf.model.layers]
    assert moe == ([False, True, True] if style != "dense" else [False] * 3)
    ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() < 1e-4
    assert generate(model, ids.tolist(), 6) == hf_greedy(hf, ids, 6)


def test_refusals():
    base = dict(MT_SHAPE, q_lora_rank=24, **MT_YARN, **MT_MOE)
    assert hf_architecture(GPTConfig(**base)) == "DeepseekV3ForCausalLM"
    for extra, message in [
        (dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False), "sigmoid routing"),
        (dict(moe_shared_expert_gate=True), "no --moe-shared-expert-gate"),
        (dict(moe_shared_expert_intermediate_size=None), "shared experts"),
        (dict(moe_shared_expert_intermediate_size=24), "a multiple of --moe-ffn-hidden-size"),
        (dict(moe_layer_freq=[1, 0, 1]), "--moe-layer-freq"),
        (dict(moe_router_topk=2, moe_router_group_topk=2), "by its top 2"),
        (dict(qk_layernorm=False), "--qk-layernorm"),
        (dict(add_bias_linear=True), "--disable-bias-linear"),
        (dict(norm_epsilon=1e-5), "--norm-epsilon"),
        (dict(mscale=0.8, mscale_all_dim=0.0), "--mscale 0.8 with --mscale-all-dim 0.0"),
        (dict(rope_type="rope", mscale_all_dim=1.0), "--rope-type rope"),
    ]:
        with pytest.raises(UnsupportedModelError, match=message):
            hf_architecture(GPTConfig(**{**base, **extra}))

    hf = {"architectures": ["DeepseekV3ForCausalLM"], **HF_SHAPE, **MOE, "q_lora_rank": 24, "rope_parameters": YARN,
          "num_hidden_layers": 3}
    cfg, arch = gpt_config_from_hf(hf, 128)
    assert arch == "DeepseekV3ForCausalLM" and cfg.mscale == 0.707 and cfg.moe_router_enable_expert_bias
    # mscale without mscale_all_dim: transformers ignores mscale, so does the import (mscale 1)
    cfg, _ = gpt_config_from_hf({**hf, "rope_parameters": {**YARN, "mscale_all_dim": 0}}, 128)
    assert cfg.mscale == 1.0 and cfg.mscale_all_dim == 0.0
    # DeepSeek-V3's own config.json: the class defaults, transformers 4's rope_scaling key with "type"
    v3 = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "rope_theta": 10000,
          "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, "max_position_embeddings": 163840,
          "num_nextn_predict_layers": 1}
    cfg, _ = gpt_config_from_hf(v3, 129280)
    assert (cfg.num_layers, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.num_moe_experts, cfg.moe_router_topk) == \
        (61, 1536, 512, 256, 8)
    assert cfg.moe_layer_freq == [0] * 3 + [1] * 58 and cfg.moe_router_num_groups == 8
    assert cfg.moe_router_group_topk == 4 and cfg.moe_shared_expert_intermediate_size == 2048
    assert cfg.rotary_scaling_factor == 40.0 and cfg.yarn_original_max_position_embeddings == 4096
    assert hf_architecture(cfg) == "DeepseekV3ForCausalLM"
    # no group limit: n_group = topk_group
    cfg, _ = gpt_config_from_hf({**hf, "n_group": 2, "topk_group": 2}, 128)
    assert cfg.moe_router_num_groups is None and cfg.moe_router_group_topk is None
    for extra, message in [
        (dict(norm_topk_prob=False), "field norm_topk_prob"),
        (dict(attention_bias=True), "field attention_bias"),
        (dict(rope_interleave=False), "field rope_interleave"),
        (dict(rms_norm_eps=1e-5), "field rms_norm_eps"),
        (dict(num_key_value_heads=2), "field num_key_value_heads"),
        (dict(scoring_func="softmax"), "field scoring_func"),
        (dict(n_shared_experts=0), "field n_shared_experts"),
        (dict(num_experts_per_tok=2, topk_group=2), "topk_group 2 with num_experts_per_tok 2"),
        (dict(num_experts_per_tok=4, topk_group=1), "topk_group 1 with num_experts_per_tok 4"),
        (dict(rope_parameters={**YARN, "rope_type": "longrope"}), "rope type 'longrope'"),
        (dict(rope_parameters={**YARN, "mscale": 0}), "mscale 0 with mscale_all_dim 0.707"),
        (dict(rope_parameters={**YARN, "attention_factor": 2.0}), "attention_factor"),
    ]:
        with pytest.raises(UnsupportedModelError, match=message):
            gpt_config_from_hf({**hf, **extra}, 128)


def test_multi_token_prediction_weights_are_refused(tmp_path):
    from safetensors.torch import save_file
    hf = hf_model("dense_rope")
    hf.save_pretrained(str(tmp_path / "src"))
    state = load_file(str(tmp_path / "src" / "model.safetensors"))
    state["model.layers.2.enorm.weight"] = torch.ones(64)  # DeepSeek's MTP layer after the 2 layers
    save_file(state, str(tmp_path / "src" / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="multi-token-prediction"):
        import_hf_model(str(tmp_path / "src"), str(tmp_path / "ckpt"), progress=False)


def test_import_of_the_fused_expert_layout(tmp_path):
    """transformers 5's in-memory layout (mlp.experts.gate_up_proj [E, 2F, h], down_proj [E, h, F])
    saved as it is imports too."""
    from safetensors.torch import save_file
    hf = hf_model("moe_q_lora")
    hf.save_pretrained(str(tmp_path / "hf"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(src / "model.safetensors"))
    import_hf_model(str(src), str(tmp_path / "ckpt"), progress=False)
    model, _ = load_model(str(tmp_path / "ckpt"), torch.device("cpu"))
    ids = tokens()
    with torch.no_grad():
        assert max_diff(model(ids), hf(ids).logits) < 1e-4
