"""Multi-latent attention in Megatron-LM checkpoints: bit-exact round trips megatrain -> Megatron (torch_dist,
legacy torch under TP 1/2 x PP 1/2, Transformer Engine and local names) -> megatrain, the MLA args in the
stored ``args``, Megatron's TE names (latent norms fused into the up projections, ``input_layernorm`` apart) and
the TP shard layouts (up projections split by heads, down projections whole under TE, split under local)."""

from __future__ import annotations

import os

import pytest
import torch

from megatrain import checkpoint as C
from megatrain.convert.export_hf import load_full_state_dict
from megatrain.convert.megatron import names
from megatrain.convert.megatron.args import config_from_megatron_args, megatron_args
from megatrain.convert.megatron.bridge import export_megatron
from megatrain.convert.megatron.pickles import load_megatron_pt
from megatrain.convert.megatron.reader import read_megatron_checkpoint
from tests.unit.test_megatron_ckpt import LLAMA, _ours, import_equals_ours

MLA = dict(LLAMA, num_query_groups=None, multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=8,
           qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=6, qk_layernorm=True, rotary_scaling_factor=4.0,
           mscale=0.707, mscale_all_dim=0.707, max_position_embeddings=64)
MLA_PLAIN = dict(MLA, q_lora_rank=None, qk_layernorm=False, rope_type="rope", rotary_scaling_factor=1.0,
                 mscale=1.0, mscale_all_dim=0.0)
MLA_LN = dict(MLA, normalization="LayerNorm", add_bias_linear=True, swiglu=False, gelu_approximation="tanh")
MLA_MOE = dict(MLA, num_moe_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2,
               moe_shared_expert_intermediate_size=8)
SHAPES = {"mla": MLA, "mla-plain": MLA_PLAIN, "mla-layernorm": MLA_LN, "mla-moe": MLA_MOE}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("saver,tp,pp,impl", [("mcore", 1, 1, "transformer_engine"), ("mcore", 1, 1, "local"),
                                              ("megatron", 1, 1, "transformer_engine"),
                                              ("megatron", 2, 2, "transformer_engine"), ("megatron", 2, 1, "local")])
def test_mla_round_trip_is_bit_exact(tmp_path, shape, saver, tp, pp, impl):
    ours, cfg = _ours(tmp_path, SHAPES[shape])
    out = str(tmp_path / "megatron")
    export_megatron(ours, out, saver=saver, tp=tp, pp=pp, transformer_impl=impl, progress=False)
    ck = read_megatron_checkpoint(out, progress=False)
    assert ck.args.multi_latent_attention and ck.args.q_lora_rank == cfg.q_lora_rank
    import_equals_ours(out, str(tmp_path / "back"), ours, cfg)  # the config too: every MLA field came back


def test_mla_args_round_trip():
    for shape in SHAPES.values():
        from megatrain.models.gpt.config import GPTConfig

        cfg = GPTConfig(**shape)
        args = megatron_args(cfg, tp=1, pp=1, iteration=1)
        for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                     "rotary_scaling_factor", "mscale", "mscale_all_dim", "rope_type", "qk_layernorm"):
            assert getattr(args, name) == getattr(cfg, name), name
        assert args.multi_latent_attention is True and args.group_query_attention is False
        assert config_from_megatron_args(args, "test") == cfg


def _rank_model(out: str, rank_dir: str) -> dict[str, torch.Tensor]:
    return load_megatron_pt(os.path.join(out, "iter_0000007", rank_dir, "model_optim_rng.pt"))["model"]


def test_transformer_engine_names_and_shards(tmp_path):
    ours, cfg = _ours(tmp_path, MLA)
    full = names.to_megatron(load_full_state_dict(C.find_checkpoint(ours), cfg), swiglu=True)
    out = str(tmp_path / "te")
    export_megatron(ours, out, saver="megatron", tp=2, pp=1, transformer_impl="transformer_engine", progress=False)
    r1 = _rank_model(out, "mp_rank_01")
    a = "decoder.layers.1.self_attention."
    # Megatron's TE spec: the latent norms inside the up projections, the input norm a module of its own
    assert torch.equal(r1[a + "linear_q_up_proj.layer_norm_weight"], full[a + "q_layernorm.weight"])
    assert torch.equal(r1[a + "linear_kv_up_proj.layer_norm_weight"], full[a + "kv_layernorm.weight"])
    assert "decoder.layers.1.input_layernorm.weight" in r1 and a + "linear_qkv.layer_norm_weight" not in r1
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in r1 and a + "q_layernorm.weight" not in r1
    # TELinear(parallel_mode="duplicated"): the down projections whole on every rank
    assert torch.equal(r1[a + "linear_q_down_proj.weight"], full[a + "linear_q_down_proj.weight"])
    assert torch.equal(r1[a + "linear_kv_down_proj.weight"], full[a + "linear_kv_down_proj.weight"])
    # column parallel by heads (rank 1: heads 2 and 3), row parallel output
    n_q, n_kv, v = 6 + 4, 6 + 6, 6
    assert torch.equal(r1[a + "linear_q_up_proj.weight"], full[a + "linear_q_up_proj.weight"][2 * n_q:])
    assert torch.equal(r1[a + "linear_kv_up_proj.weight"], full[a + "linear_kv_up_proj.weight"][2 * n_kv:])
    assert torch.equal(r1[a + "linear_proj.weight"], full[a + "linear_proj.weight"][:, 2 * v:])
    assert r1[a + "linear_q_up_proj._extra_state"] is None and r1[a + "linear_kv_down_proj._extra_state"] is None
    # torch_dist: the same TE names, stacked
    mc = str(tmp_path / "mc")
    export_megatron(ours, mc, saver="mcore", progress=False)
    from megatrain.convert.megatron.pickles import load_megatron_dcp_metadata

    keys = set(load_megatron_dcp_metadata(os.path.join(mc, "iter_0000007")).state_dict_metadata)
    for key in ("input_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight",
                "self_attention.linear_kv_up_proj.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight",
                "self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight"):
        assert f"decoder.layers.{key}" in keys, key
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" not in keys


def test_local_names_and_shards(tmp_path):
    ours, cfg = _ours(tmp_path, MLA)
    full = names.to_megatron(load_full_state_dict(C.find_checkpoint(ours), cfg), swiglu=True)
    out = str(tmp_path / "local")
    export_megatron(ours, out, saver="megatron", tp=2, pp=1, transformer_impl="local", progress=False)
    r1 = _rank_model(out, "mp_rank_01")
    a = "decoder.layers.0.self_attention."
    assert torch.equal(r1[a + "q_layernorm.weight"], full[a + "q_layernorm.weight"])
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in r1
    # the local spec's ColumnParallelLinear down projections: split on dim 0 (gathered in Megatron's forward)
    assert torch.equal(r1[a + "linear_q_down_proj.weight"], full[a + "linear_q_down_proj.weight"][6:])
    assert torch.equal(r1[a + "linear_kv_down_proj.weight"], full[a + "linear_kv_down_proj.weight"][6:])


def test_moe_layer_keeps_its_pre_mlp_norm_apart(tmp_path):
    ours, _ = _ours(tmp_path, MLA_MOE)
    out = str(tmp_path / "te")
    export_megatron(ours, out, saver="megatron", tp=1, pp=1, progress=False)
    r0 = _rank_model(out, "mp_rank_00")
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in r0
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" not in r0


def test_names_megatrain_has_no_place_for_are_refused():
    assert names.canonical_name("decoder.layers.3.self_attention.linear_kv_up_proj.layer_norm_weight") == \
        "decoder.layers.3.self_attention.kv_layernorm.weight"
    for rest in ("self_attention.linear_q_proj.layer_norm_weight", "self_attention.linear_qkv_down_proj.weight"):
        with pytest.raises(names.UnsupportedMegatronModel):
            names.canonical_name(f"decoder.layers.0.{rest}")
    for te in (True, False):
        t = torch.arange(48.0).view(12, 4)
        for name in ("decoder.layers.0.self_attention.linear_q_down_proj.weight",
                     "decoder.layers.0.self_attention.linear_kv_up_proj.weight"):
            parts = names.split_tp(name, t, 2, swiglu=True, te=te)
            assert torch.equal(names.merge_tp(name, parts, swiglu=True, te=te), t)
