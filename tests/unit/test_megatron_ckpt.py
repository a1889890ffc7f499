"""Megatron-LM checkpoints in and out without megatron-core: bit-exact round trips megatrain -> Megatron
(torch_dist, legacy torch under TP 1/2 x PP 1/2) -> megatrain for GPT-2 and LLaMA shapes, the TP shard
layouts (grouped QKV, SwiGLU halves), the refusal of hostile pickles, and the converter's command line.
(tests/e2e/test_megatron_ckpt_mcore.py checks the same files against megatron-core itself.)"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from megatrain import checkpoint as C
from megatrain.convert.export_hf import load_full_state_dict
from megatrain.convert.megatron import names
from megatrain.convert.megatron.bridge import export_megatron, import_megatron
from megatrain.convert.megatron.cli import main as convert_main
from megatrain.convert.megatron.pickles import MegatronEnum, load_megatron_pt
from megatrain.convert.megatron.reader import read_megatron_checkpoint
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.registry import get_family

GPT2 = dict(num_layers=4, hidden_size=16, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64,
            max_position_embeddings=32, gelu_approximation="tanh")
LLAMA = dict(num_layers=4, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
             vocab_size=64, max_position_embeddings=32, swiglu=True, add_bias_linear=False, normalization="RMSNorm",
             position_embedding_type="rope", untie_embeddings_and_output_weights=True, gelu_approximation="none")


def _ours(tmp_path, shape) -> tuple[str, GPTConfig]:
    cfg = GPTConfig(**shape)
    torch.manual_seed(0)
    model = get_family("gpt").build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save = str(tmp_path / "ours")
    C.save_checkpoint(save, C.TrainState(iteration=7, consumed_train_samples=56, consumed_valid_samples=4), model,
                      None, {}, argparse.Namespace(seq_length=16), cfg, save_optim=False, save_rng=False)
    return save, cfg

def import_equals_ours(megatron_dir: str, back: str, ours: str, cfg):
    """Import ``megatron_dir`` into ``back``: the config and every weight equal ``ours``' exactly; the report."""
    report = import_megatron(megatron_dir, back, progress=False, quiet=True)
    assert report.config == cfg
    a = load_full_state_dict(C.find_checkpoint(ours), cfg)
    b = load_full_state_dict(report.path, report.config)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    return report



@pytest.mark.parametrize("shape", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("saver,tp,pp", [("mcore", 1, 1), ("megatron", 1, 1), ("megatron", 2, 1),
                                         ("megatron", 1, 2), ("megatron", 2, 2)])
def test_round_trip_is_bit_exact(tmp_path, shape, saver, tp, pp):
    ours, cfg = _ours(tmp_path, shape)
    out = str(tmp_path / "megatron")
    export_megatron(ours, out, saver=saver, tp=tp, pp=pp, progress=False)
    it_dir = os.path.join(out, "iter_0000007")
    if saver == "mcore":
        assert sorted(n for n in os.listdir(it_dir) if not n.endswith(".distcp")) == [".metadata", "common.pt",
                                                                                       "metadata.json"]
    else:
        want = {f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp)}
        assert set(os.listdir(it_dir)) == want
    report = import_equals_ours(out, str(tmp_path / "back"), ours, cfg)
    ts = C.read_meta(report.path)["train_state"]
    assert (ts["iteration"], ts["consumed_train_samples"], ts["consumed_valid_samples"]) == (7, 56, 4)


def test_legacy_shards_have_megatron_layouts(tmp_path):
    ours, cfg = _ours(tmp_path, LLAMA)
    out = str(tmp_path / "m")
    export_megatron(ours, out, saver="megatron", tp=2, pp=2, transformer_impl="local", progress=False)
    full = names.to_megatron(load_full_state_dict(C.find_checkpoint(ours), cfg), swiglu=True)
    r0 = load_megatron_pt(os.path.join(out, "iter_0000007", "mp_rank_01_001", "model_optim_rng.pt"))
    model = r0["model"]
    # stage 1 numbers its layers from 0: its layer 0 is global layer 2
    qkv = model["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, hpg = 4, 2  # head dim, query heads per group: rank 1 holds the second query group whole
    assert torch.equal(qkv, full["decoder.layers.2.self_attention.linear_qkv.weight"][(hpg + 2) * d:])
    fc1 = model["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = full["decoder.layers.2.mlp.linear_fc1.weight"].chunk(2)
    assert torch.equal(fc1, torch.cat([gate[12:], up[12:]]))  # this rank's [gate_r; up_r]
    assert torch.equal(model["decoder.layers.0.self_attention.linear_proj.weight"],
                       full["decoder.layers.2.self_attention.linear_proj.weight"][:, 8:])
    assert "decoder.layers.0.input_layernorm.weight" in model and "embedding.word_embeddings.weight" not in model
    assert model["decoder.layers.0.mlp.linear_fc1._extra_state"] is None
    assert r0["iteration"] == 7 and r0["args"].num_layers == 4 and r0["args"].tensor_model_parallel_size == 2


def test_transformer_engine_names_read_as_local_ones(tmp_path):
    ours, cfg = _ours(tmp_path, GPT2)
    out = str(tmp_path / "m")
    export_megatron(ours, out, saver="megatron", tp=1, pp=1, transformer_impl="transformer_engine", progress=False)
    sd = load_megatron_pt(os.path.join(out, "iter_0000007", "mp_rank_00", "model_optim_rng.pt"))["model"]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in sd
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_bias" in sd
    ck = read_megatron_checkpoint(out, progress=False)
    assert "decoder.layers.3.input_layernorm.weight" in ck.tensors and ck.format == "torch"


def _hostile_pt(path: str, marker: str) -> None:
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"args": argparse.Namespace(num_layers=1), "model": {}, "x": Evil()}, path)


def test_hostile_pickle_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    d = tmp_path / "ckpt" / "iter_0000001" / "mp_rank_00"
    d.mkdir(parents=True)
    _hostile_pt(str(d / "model_optim_rng.pt"), str(marker))
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(C.CheckpointError) as e:
        read_megatron_checkpoint(str(tmp_path / "ckpt"), progress=False)
    assert "\n" not in str(e.value) and "refused" in str(e.value) and "system" in str(e.value)
    assert not marker.exists()
    # the converter prints it as one line, exit status 2
    with pytest.raises(SystemExit) as ex:
        convert_main(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatrain", "--load-dir",
                      str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "out"), "--no-progress"])
    assert ex.value.code == 2 and not marker.exists()


def test_hostile_common_pt_in_torch_dist_is_refused(tmp_path):
    ours, _ = _ours(tmp_path, GPT2)
    out = tmp_path / "m"
    export_megatron(ours, str(out), saver="mcore", progress=False)
    marker = tmp_path / "pwned"
    _hostile_pt(str(out / "iter_0000007" / "common.pt"), str(marker))
    with pytest.raises(C.CheckpointError, match="refused"):
        read_megatron_checkpoint(str(out), progress=False)
    assert not marker.exists()


def test_megatron_enums_and_numpy_rng_become_stand_ins(tmp_path):
    """A common.pt as Megatron writes it: enum members, dtypes, numpy RNG arrays: read, nothing imported."""
    import enum

    import numpy as np

    class ModelType(enum.Enum):
        encoder_or_decoder = 1

    ModelType.__module__ = "megatron.core.enums"
    ModelType.__qualname__ = "ModelType"
    import sys
    import types
    mod = types.ModuleType("megatron.core.enums")  # pickled by name, as from megatron-core; never imported back
    mod.ModelType = ModelType
    saved = {k: sys.modules.get(k) for k in ("megatron", "megatron.core", "megatron.core.enums")}
    sys.modules.update({"megatron": types.ModuleType("megatron"), "megatron.core": types.ModuleType("megatron.core"),
                        "megatron.core.enums": mod})
    try:
        path = tmp_path / "common.pt"
        torch.save({"args": argparse.Namespace(model_type=ModelType.encoder_or_decoder, params_dtype=torch.bfloat16),
                    "rng_state": [{"np_rng_state": np.random.get_state()}], "iteration": 3}, str(path))
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    loaded = load_megatron_pt(str(path))
    assert isinstance(loaded["args"].model_type, MegatronEnum) and loaded["args"].model_type.value == 1
    assert loaded["args"].params_dtype is torch.bfloat16 and loaded["iteration"] == 3


def test_tp_merge_and_split_are_inverse():
    t = torch.arange(48.0).view(12, 4)
    for name in ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
                 "decoder.layers.0.self_attention.linear_proj.weight", "decoder.final_layernorm.weight"):
        for tp in (1, 2, 4):
            parts = names.split_tp(name, t, tp, swiglu=True)
            assert torch.equal(names.merge_tp(name, parts, swiglu=True), t)


def test_cli_megatron_to_megatron_and_refusals(tmp_path, capsys):
    ours, cfg = _ours(tmp_path, LLAMA)
    mc = str(tmp_path / "mcore")
    convert_main(["--model-type", "GPT", "--loader", "megatrain", "--saver", "mcore", "--load-dir", ours,
                  "--save-dir", mc, "--megatron-path", "/nowhere", "--no-progress"])
    assert "--megatron-path /nowhere is not used" in capsys.readouterr().out
    legacy = str(tmp_path / "legacy")
    convert_main(["--model-type", "GPT", "--loader", "mcore", "--saver", "megatron", "--load-dir", mc, "--save-dir",
                  legacy, "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2",
                  "--no-progress"])
    back = str(tmp_path / "back")
    convert_main(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatrain", "--load-dir", legacy,
                  "--save-dir", back, "--no-progress"])
    a = load_full_state_dict(C.find_checkpoint(ours), cfg)
    b = load_full_state_dict(C.find_checkpoint(back), cfg)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for argv, words in [(["--loader", "megatrain", "--saver", "megatrain"], "same format"),
                        (["--loader", "llama_mistral", "--checkpoint-type", "meta", "--saver", "mcore"], "meta"),
                        (["--loader", "megatron", "--saver", "megatrain", "--load-dir", str(tmp_path / "none")],
                         "no such file")]:
        full = ["--model-type", "GPT", "--load-dir", ours, "--save-dir", str(tmp_path / "x"), *argv]
        with pytest.raises(SystemExit) as ex:
            convert_main(full)
        err = capsys.readouterr().err.strip()
        assert ex.value.code == 2 and words in err and "\n" not in err, err
    with pytest.raises(SystemExit):  # an unknown saver: argparse's one line
        convert_main(["--model-type", "GPT", "--loader", "megatrain", "--saver", "zarr", "--load-dir", ours,
                      "--save-dir", str(tmp_path / "x")])


MOE = dict(LLAMA, num_moe_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2, moe_shared_expert_intermediate_size=8,
           moe_shared_expert_gate=True, moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")


@pytest.mark.parametrize("saver,tp,pp", [("mcore", 1, 1), ("megatron", 2, 2)])
def test_moe_round_trip_is_bit_exact(tmp_path, saver, tp, pp):
    ours, cfg = _ours(tmp_path, MOE)
    out = str(tmp_path / "megatron")
    export_megatron(ours, out, saver=saver, tp=tp, pp=pp, progress=False)
    ck = read_megatron_checkpoint(out, progress=False)
    assert "decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight" in ck.tensors
    assert "decoder.layers.0.mlp.shared_experts.gate_weight" in ck.tensors
    import_equals_ours(out, str(tmp_path / "back"), ours, cfg)
