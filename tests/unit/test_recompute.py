"""Activation recomputation: which modules are wrapped, that they really run again, same numbers."""

from __future__ import annotations

import copy

import pytest
import torch

from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel, canonical_parameter_name
from megatrain.parallel.recompute import RecomputeConfig, apply_activation_checkpointing


def _model() -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(GPTConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=64,
                              max_position_embeddings=16, hidden_dropout=0.1, attention_dropout=0.1))


def _forward_counts(model: GPTModel, module_of_layer) -> tuple[list[int], float, dict]:
    counts = [0] * len(model.layers)
    for i, layer in enumerate(model.layers.values()):
        def hook(*_, i=i):
            counts[i] += 1
        module_of_layer(layer).register_forward_pre_hook(hook)  # recomputation may stop before the end
    torch.manual_seed(1)
    tokens = torch.randint(0, 64, (2, 16))
    loss = model(tokens, labels=tokens).mean()
    loss.backward()
    grads = {canonical_parameter_name(n): p.grad.clone() for n, p in model.named_parameters()}
    return counts, loss.item(), grads


@pytest.mark.parametrize("cfg, expected", [
    (RecomputeConfig(None), [1, 1, 1]),
    (RecomputeConfig("full", "uniform", 1), [2, 2, 2]),
    (RecomputeConfig("full", "uniform", 2), [2, 2, 2]),
    (RecomputeConfig("full", "block", 2), [2, 2, 1]),
    (RecomputeConfig("full", "block", 0), [1, 1, 1]),
])
def test_full_recompute_runs_chosen_layers_again_with_identical_numbers(cfg, expected):
    base = _model()
    model = copy.deepcopy(base)
    _, ref_loss, ref_grads = _forward_counts(base, lambda layer: layer.mlp)
    apply_activation_checkpointing(model, cfg)
    counts, loss, grads = _forward_counts(model, lambda layer: layer.mlp)
    assert counts == expected
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)  # dropout masks replayed exactly


def _core(layer):
    core = layer.self_attention.core_attention
    return getattr(core, "_checkpoint_wrapped_module", core)  # count the inner module's runs


def test_selective_recompute_reruns_only_core_attention():
    base = _model()
    model = copy.deepcopy(base)
    _, ref_loss, ref_grads = _forward_counts(base, _core)
    wrapped = apply_activation_checkpointing(model, RecomputeConfig("selective"))
    assert wrapped == [f"layers.{i}.self_attention.core_attention" for i in range(3)]
    same_model = copy.deepcopy(model)
    counts, loss, grads = _forward_counts(model, _core)
    mlp_counts, _, _ = _forward_counts(same_model, lambda layer: layer.mlp)
    assert counts == [2, 2, 2] and mlp_counts == [1, 1, 1]
    assert loss == ref_loss and all(torch.equal(grads[k], ref_grads[k]) for k in grads)


def _saved_bytes(model: GPTModel) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of one forward."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    torch.manual_seed(1)
    tokens = torch.randint(0, 64, (2, 16))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels=tokens).mean()
    return total[0]


def test_recompute_modules_mlp_reruns_the_mlps_keeps_less_and_gives_the_same_numbers():
    base = _model()
    model = copy.deepcopy(base)
    _, ref_loss, ref_grads = _forward_counts(base, lambda layer: layer.mlp)
    cfg = RecomputeConfig("selective", modules=("core_attn", "mlp"))
    wrapped = apply_activation_checkpointing(model, cfg)
    assert wrapped == [f"layers.{i}.mlp" for i in range(3)] + \
        [f"layers.{i}.self_attention.core_attention" for i in range(3)]
    inner = copy.deepcopy(model)
    counts, loss, grads = _forward_counts(inner, lambda layer: layer.mlp._checkpoint_wrapped_module)
    assert counts == [2, 2, 2]
    assert loss == ref_loss and all(torch.equal(grads[k], ref_grads[k]) for k in grads)
    attention_only = copy.deepcopy(base)
    apply_activation_checkpointing(attention_only, RecomputeConfig("selective"))
    assert _saved_bytes(model) < _saved_bytes(attention_only) < _saved_bytes(base)


def test_recompute_modules_without_core_attn_leave_attention_alone():
    model = _model()
    assert apply_activation_checkpointing(model, RecomputeConfig("selective", modules=("mlp",))) == \
        [f"layers.{i}.mlp" for i in range(3)]


def test_recompute_modules_megatrain_does_not_know_are_refused():
    with pytest.raises(ValueError, match="--recompute-modules mhc: not a module megatrain recomputes"):
        RecomputeConfig("selective", modules=("core_attn", "mhc"))


def test_recompute_modules_that_would_save_nothing_are_accepted_with_a_note():
    """Megatron's DeepSeek-V3 example asks for ``mlp moe mla_up_proj layernorm``: the last two (and moe_act)
    drop outputs the next matmul saves anyway here; they wrap nothing and say so at start-up."""
    from megatrain.training.arguments import parse_args

    model = _model()
    assert apply_activation_checkpointing(model, RecomputeConfig("selective", modules=("layernorm", "moe_act",
                                                                                      "mla_up_proj"))) == []
    args = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                       "--max-position-embeddings", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--recompute-granularity",
                       "selective", "--recompute-modules", "mlp", "moe", "mla_up_proj", "layernorm", "--mock-data",
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"])
    notes = [n for n in args.legacy_notes if "--recompute-modules" in n]
    assert len(notes) == 2 and "mla_up_proj changes nothing here" in notes[0] and "layernorm" in notes[1]


def test_recompute_modules_flag_reaches_the_config_and_turns_the_fusion_off():
    from megatrain.parallel.parallelize import ParallelizeConfig, grad_accumulation_fusion_applies
    from megatrain.parallel.dims import ParallelDims
    from megatrain.training.arguments import parse_args
    from megatrain.training.run_config import RunConfig

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--device", "cpu",
            "--bf16"]
    a = parse_args([*base, "--recompute-granularity", "selective", "--recompute-modules", "mlp", "moe"])
    cfg = RunConfig.from_args(a).parallelize
    assert cfg.recompute.modules == ("mlp", "moe") and cfg.recompute.moe_layer
    assert not grad_accumulation_fusion_applies(cfg, ParallelDims(1), fsdp=False)
    attention = RunConfig.from_args(parse_args([*base, "--recompute-granularity", "selective"])).parallelize
    assert attention.recompute.modules == ("core_attn",)
    assert grad_accumulation_fusion_applies(attention, ParallelDims(1), fsdp=False)
    ignored = parse_args([*base, "--recompute-modules", "mlp"])
    assert any("--recompute-modules chooses what" in n for n in ignored.legacy_notes)
    assert isinstance(cfg, ParallelizeConfig)
