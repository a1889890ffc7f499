"""Adam's state and the fp16 loss scaler through Megatron-LM's legacy ``torch`` format (``model_optim_rng.pt`` per
TP x PP rank, megatron-core's non-distributed optimizer's ``state_dict()`` by parameter index): megatrain ->
``--saver megatron`` (TP 2 x PP 2) -> megatrain keeps every moment, the step and the weights bit-exact (LLaMA, a
tied GPT-2 shape and multi-latent attention); an fp16 run's dynamic loss scaler and fp32 main params travel in
both formats; state that does not fit megatron-core's parameter order exactly is refused in one note, never
mis-mapped. (The layouts against megatron-core's own FP32Optimizer / Float16OptimizerWithFloat16Params:
tests/e2e/test_megatron_ckpt_mcore.py.)"""

from __future__ import annotations

import argparse
import os

import torch

from megatrain import checkpoint as C
from megatrain.convert.export_hf import load_full_state_dict
from megatrain.convert.megatron.bridge import export_megatron, import_megatron
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.registry import get_family
from megatrain.optimizer import OptimizerConfig, build_optimizer
from tests.unit.test_megatron_optim_state import trained

LLAMA = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
             vocab_size=64, max_position_embeddings=32, swiglu=True, add_bias_linear=False, normalization="RMSNorm",
             position_embedding_type="rope", untie_embeddings_and_output_weights=True, gelu_approximation="none")
GPT2 = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, vocab_size=64,
            max_position_embeddings=32, untie_embeddings_and_output_weights=False)
MLA = dict(LLAMA, num_query_groups=None, multi_latent_attention=True, q_lora_rank=8, kv_lora_rank=8, qk_head_dim=4,
           qk_pos_emb_head_dim=4, v_head_dim=4, qk_layernorm=True)
SCALER = {"scale": 8192.0, "growth_tracker": 37, "hysteresis_tracker": 1}


def _save(tmp_path, cfg: GPTConfig, **flags) -> str:
    model, opt = trained(cfg, steps=3)
    save = str(tmp_path / "ours")
    extra = {"loss_scaler": dict(SCALER)} if flags.get("fp16") else {}
    C.save_checkpoint(save, C.TrainState(iteration=3, consumed_train_samples=12), model, opt, extra,
                      argparse.Namespace(seq_length=16, **flags), cfg, save_rng=False)
    return save


def _state(ckpt: str, cfg: GPTConfig):
    model = get_family("gpt").build_model(cfg)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2, weight_decay=0.1))
    C.load_checkpoint(ckpt, model, opt, load_rng=False)
    return {n: opt.state[p] for n, p in model.named_parameters()}, load_full_state_dict(ckpt, cfg)


def _same(a_ckpt: str, b_ckpt: str, cfg: GPTConfig) -> None:
    (a, wa), (b, wb) = _state(a_ckpt, cfg), _state(b_ckpt, cfg)
    assert a.keys() == b.keys() and wa.keys() == wb.keys()
    for name in a:
        assert int(a[name]["step"]) == int(b[name]["step"]) == 3
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a[name][kind], b[name][kind]), (name, kind)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def _rank_file(out: str, rank: str = "mp_rank_00_000") -> dict:
    return torch.load(os.path.join(out, "iter_0000003", rank, "model_optim_rng.pt"), weights_only=False)


def test_legacy_round_trip_is_bit_exact(tmp_path, capsys):
    for name, shape in (("llama", LLAMA), ("gpt2", GPT2), ("mla", MLA)):
        cfg = GPTConfig(**shape)
        ours = _save(tmp_path / name, cfg)
        out = str(tmp_path / name / "legacy")
        export_megatron(ours, out, saver="megatron", tp=2, pp=2, progress=False)
        assert "not written" not in capsys.readouterr().out
        sd = _rank_file(out, "mp_rank_01_001")
        keys = [k for k in sd["model"] if not k.endswith("_extra_state")]
        # megatron-core's parameter order: its Attention registers linear_proj before linear_qkv
        attention = [k.removeprefix("decoder.layers.0.self_attention.") for k in keys
                     if k.startswith("decoder.layers.0.self_attention.")]
        if name == "mla":  # MLASelfAttention's order (the latent norms are TE's fused layer_norm_weight)
            assert attention == ["linear_proj.weight", "linear_q_down_proj.weight",
                                 "linear_q_up_proj.layer_norm_weight", "linear_q_up_proj.weight",
                                 "linear_kv_down_proj.weight",
                                 "linear_kv_up_proj.layer_norm_weight", "linear_kv_up_proj.weight"], attention
        else:
            assert attention.index("linear_proj.weight") < attention.index("linear_qkv.weight")
        opt = sd["optimizer"]  # FP32Optimizer.state_dict(): torch's, weight-decay group first
        groups = opt["param_groups"]
        assert [g["wd_mult"] for g in groups] == [1.0, 0.0]
        assert sum((g["params"] for g in groups), []) == list(range(len(keys))) == sorted(opt["state"])
        report = import_megatron(out, str(tmp_path / name / "back"), progress=False, quiet=True)
        assert report.note is None and C.read_meta(report.path)["has_optimizer"]
        _same(C.find_checkpoint(ours), report.path, cfg)


def test_fp16_loss_scaler_and_main_params_travel(tmp_path):
    cfg = GPTConfig(**LLAMA)
    ours = _save(tmp_path, cfg, fp16=True)
    for saver, tp, pp in (("megatron", 2, 1), ("mcore", 1, 1)):
        out = str(tmp_path / saver)
        export_megatron(ours, out, saver=saver, tp=tp, pp=pp, progress=False)
        if saver == "megatron":  # Float16OptimizerWithFloat16Params.state_dict(): fp16 weights, fp32 main params
            sd = _rank_file(out, "mp_rank_01")
            assert sd["args"].fp16 and set(sd["optimizer"]) == {"optimizer", "grad_scaler", "fp32_from_fp16_params"}
            assert all(t.dtype == torch.float16 for k, t in sd["model"].items() if not k.endswith("_extra_state"))
            gs = sd["optimizer"]["grad_scaler"]
            assert gs["scale"].tolist() == [8192.0] and (gs["growth_tracker"], gs["hysteresis_tracker"]) == (37, 1)
        else:
            common = torch.load(os.path.join(out, "iter_0000003", "common.pt"), weights_only=False)
            assert common["optimizer"]["grad_scaler"]["growth_tracker"] == 37
        report = import_megatron(out, str(tmp_path / f"{saver}_back"), progress=False, quiet=True)
        assert report.note is None
        assert C.read_meta(report.path)["loss_scaler"] == SCALER, saver
        _same(C.find_checkpoint(ours), report.path, cfg)  # the weights are the fp32 main params, bit-exact


def test_bf16_main_params_travel(tmp_path):
    cfg = GPTConfig(**GPT2)
    ours = _save(tmp_path, cfg, bf16=True)
    for saver in ("megatron", "mcore"):
        out = str(tmp_path / saver)
        export_megatron(ours, out, saver=saver, pp=2 if saver == "megatron" else 1, progress=False)
        if saver == "megatron":  # --bf16's Float16OptimizerWithFloat16Params: no grad_scaler
            sd = _rank_file(out, "mp_rank_00_001")
            assert sd["args"].bf16 and set(sd["optimizer"]) == {"optimizer", "fp32_from_fp16_params"}
            assert sd["model"]["output_layer.weight"].dtype == torch.bfloat16  # the tied copy of the last stage
        report = import_megatron(out, str(tmp_path / f"{saver}_back"), progress=False, quiet=True)
        assert report.note is None and "loss_scaler" not in C.read_meta(report.path)
        _same(C.find_checkpoint(ours), report.path, cfg)


def _rewrite(out: str, change) -> None:
    it = os.path.join(out, "iter_0000003")
    for rank in sorted(os.listdir(it)):
        path = os.path.join(it, rank, "model_optim_rng.pt")
        sd = torch.load(path, weights_only=False)
        change(sd)
        torch.save(sd, path)


def test_state_that_does_not_fit_is_refused_in_one_note(tmp_path):
    cfg = GPTConfig(**LLAMA)
    ours = _save(tmp_path, cfg)

    def swapped(sd):  # two parameters' states of different shapes exchanged: not megatron-core's order
        st = sd["optimizer"]["state"]
        st[0], st[1] = st[1], st[0]

    def regrouped(sd):  # one parameter moved to the other group
        g = sd["optimizer"]["param_groups"]
        g[1]["params"].insert(0, g[0]["params"].pop())

    def distributed(sd):  # DistributedOptimizer.state_dict(): param groups only (the moments in distrib_optim.pt)
        sd["optimizer"] = {"optimizer": {"param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                          for g in sd["optimizer"]["param_groups"]]}}

    def old_groups(sd):  # an older Megatron-LM's groups without wd_mult: which group is which cannot be told
        for g in sd["optimizer"]["param_groups"]:
            del g["wd_mult"]

    def malformed(sd):
        sd["optimizer"]["param_groups"][0]["params"] = "0-9"

    for name, change, words in (("swapped", swapped, "has shape"), ("regrouped", regrouped, "param group 0 holds"),
                                ("distributed", distributed, "distrib_optim.pt"), ("old", old_groups, "wd_mult"),
                                ("malformed", malformed, "not a torch optimizer state dict")):
        out = str(tmp_path / name)
        export_megatron(ours, out, saver="megatron", tp=2, progress=False)
        _rewrite(out, change)
        report = import_megatron(out, str(tmp_path / f"{name}_back"), progress=False, quiet=True)
        note = report.note or ""
        assert words in note and "starts fresh" in note and "\n" not in note, (name, note)
        assert not C.read_meta(report.path)["has_optimizer"]
        _, weights = _state(C.find_checkpoint(ours), cfg)
        got = load_full_state_dict(report.path, cfg)
        assert all(torch.equal(got[k], weights[k]) for k in weights)  # the weights still convert
