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
