"""Adam's state through Megatron-LM torch_dist checkpoints without megatron-core: megatrain -> ``--saver mcore`` ->
megatrain keeps every moment and the step bit-exact (LLaMA: stacked layers, grouped QKV, SwiGLU halves); what is
not converted gets one note (MoE export, the distributed optimizer's bucket layout), and an optimizer
tensor of the wrong shape one error line naming the key. (tests/e2e/test_megatron_ckpt_mcore.py checks the same
files against megatron-core's own optimizer.)"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatrain import checkpoint as C
from megatrain.checkpoint.ranks import single_process_quiet
from megatrain.convert.megatron import writer
from megatrain.convert.megatron.args import megatron_args
from megatrain.convert.megatron.bridge import export_megatron, import_megatron
from megatrain.convert.megatron.names import to_megatron
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.registry import get_family
from megatrain.optimizer import OptimizerConfig, build_optimizer

LLAMA = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
             vocab_size=64, max_position_embeddings=32, swiglu=True, add_bias_linear=False, normalization="RMSNorm",
             position_embedding_type="rope", untie_embeddings_and_output_weights=True, gelu_approximation="none")


def trained(cfg: GPTConfig, steps: int = 2):
    """A GPT-family model and its Adam after ``steps`` steps on random gradients (seeded)."""
    torch.manual_seed(0)
    model = get_family("gpt").build_model(cfg)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2, weight_decay=0.1))
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    return model, opt


def _save(tmp_path, cfg: GPTConfig, with_optim: bool = True) -> str:
    model, opt = trained(cfg)
    save = str(tmp_path / "ours")
    C.save_checkpoint(save, C.TrainState(iteration=2, consumed_train_samples=8), model, opt, {},
                      argparse.Namespace(seq_length=16), cfg, save_optim=with_optim, save_rng=False)
    return save


def _loaded(ckpt: str, cfg: GPTConfig):
    model = get_family("gpt").build_model(cfg)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2, weight_decay=0.1))
    C.load_checkpoint(ckpt, model, opt, load_rng=False)
    return {n: opt.state[p] for n, p in model.named_parameters()}


def test_adam_state_round_trip_is_bit_exact(tmp_path):
    cfg = GPTConfig(**LLAMA)
    ours = _save(tmp_path, cfg)
    out = str(tmp_path / "megatron")
    export_megatron(ours, out, saver="mcore", progress=False)
    md = C.read_dcp_metadata(os.path.join(out, "iter_0000002"))
    qkv = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"
    assert list(md.state_dict_metadata[qkv].size) == list(
        md.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"].size)
    report = import_megatron(out, str(tmp_path / "back"), progress=False, quiet=True)
    assert report.note is None and C.read_meta(report.path)["has_optimizer"]
    a, b = _loaded(C.find_checkpoint(ours), cfg), _loaded(report.path, cfg)
    assert a.keys() == b.keys()
    for name in a:
        assert int(a[name]["step"]) == int(b[name]["step"]) == 2
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a[name][kind], b[name][kind]), (name, kind)


def test_no_optimizer_state_written_says_so(tmp_path, capsys):
    cfg = GPTConfig(**LLAMA)
    ours = _save(tmp_path, cfg)
    export_megatron(ours, str(tmp_path / "legacy"), saver="megatron", progress=False)
    assert "optimizer state is not written" not in capsys.readouterr().out  # the legacy saver writes it too
    report = import_megatron(str(tmp_path / "legacy"), str(tmp_path / "back"), progress=False, quiet=True)
    assert report.note is None and C.read_meta(report.path)["has_optimizer"]
    moe = GPTConfig(**LLAMA, num_moe_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2)
    export_megatron(_save(tmp_path / "moe", moe), str(tmp_path / "moe_out"), saver="mcore", progress=False)
    out = capsys.readouterr().out
    assert "chained optimizer" in out and out.count("\n") == 1
    cfg_sgd = GPTConfig(**LLAMA)
    model = get_family("gpt").build_model(cfg_sgd)
    opt = build_optimizer(model, OptimizerConfig(optimizer="sgd"))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sgd = str(tmp_path / "sgd")
    C.save_checkpoint(sgd, C.TrainState(iteration=1), model, opt, {}, argparse.Namespace(optimizer="sgd"), cfg_sgd,
                      save_rng=False)
    export_megatron(sgd, str(tmp_path / "sgd_out"), saver="mcore", progress=False)
    out = capsys.readouterr().out
    assert "sgd; --saver mcore writes Adam's" in out and out.count("\n") == 1
    assert import_megatron(str(tmp_path / "sgd_out"), str(tmp_path / "sgd_back"), progress=False, quiet=True).note is None


def _hand_written(tmp_path, cfg: GPTConfig, extra: dict[str, torch.Tensor]) -> str:
    """A torch_dist checkpoint of ``cfg`` by megatrain's writer's own parts, with ``extra`` DCP tensors beside it."""
    model, _ = trained(cfg)
    tensors = to_megatron(model.state_dict(), cfg.swiglu)
    args = megatron_args(cfg, tp=1, pp=1, iteration=2)
    d = tmp_path / "hand" / "iter_0000002"
    d.mkdir(parents=True)
    sd = {**writer._stacked(tensors, cfg.num_layers), **extra}
    (d / "metadata.json").write_text(json.dumps(writer.DIST_METADATA))
    torch.save({**writer._common(args, 2), "optimizer": {"optimizer": {"param_groups": []}}}, d / "common.pt")
    with single_process_quiet():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(d), thread_count=1),
                 planner=writer._PackedBytesPlanner(), no_dist=True)
    return str(d)


def test_distributed_bucket_layout_is_a_note(tmp_path):
    cfg = GPTConfig(**LLAMA)
    key = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.exp_avg"
    d = _hand_written(tmp_path, cfg, {key: torch.zeros(100)})
    report = import_megatron(d, str(tmp_path / "back"), progress=False, quiet=True)
    assert report.note and "dp_reshardable" in report.note and "starts fresh" in report.note
    assert "\n" not in report.note and not C.read_meta(report.path)["has_optimizer"]


def test_optimizer_tensor_of_another_shape_is_one_line(tmp_path):
    cfg = GPTConfig(**LLAMA)
    key = "optimizer.state.exp_avg.decoder.final_layernorm.weight"
    d = _hand_written(tmp_path, cfg, {key: torch.zeros(3)})
    with pytest.raises(C.CheckpointError) as ex:
        import_megatron(d, str(tmp_path / "back"), progress=False, quiet=True)
    msg = str(ex.value)
    assert key in msg and d in msg and "\n" not in msg
