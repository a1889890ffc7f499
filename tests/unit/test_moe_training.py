"""The trainer's MoE steps, on the GPT model whose MLPs get a router of their own (a stand-in for a
MoE layer, defined here): the balancing losses' gradients carry the main loss's factor, the expert
bias moves after the backward, and the log line / TensorBoard show Megatron's MoE values."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
from torch import nn

from megatrain.models.common.init import canonical_parameter_name, seeded_normal
from megatrain.models.common.moe.router import TopKRouter
from megatrain.models.gpt.model import GPTModel
from megatrain.models.gpt.model import initial_value as gpt_initial_value
from megatrain.models.registry import get_family
from megatrain.training.arguments import parse_args
from megatrain.training.logging import parse_train_log_line
from megatrain.training.trainer import Trainer

ARGS = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", "6",
        "--num-workers", "0", "--lr", "1e-2", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--eval-iters", "0", "--no-torch-compile",
        "--device", "cpu", "--clip-grad", "0", "--num-experts", "4", "--moe-layer-freq", "[0,1]",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-aux-loss-coeff", "0.01",
        "--moe-z-loss-coeff", "0.001", "--moe-router-bias-update-rate", "0.01"]


class _RoutedMLP(nn.Module):
    """The dense MLP times the sum of the routed weights (1: the weights are normalised), so that
    the router sits in the graph as in a MoE layer."""

    def __init__(self, dense: nn.Module, config, layer: int) -> None:
        super().__init__()
        self.dense = dense
        self.router = TopKRouter(config, layer)
        self.inputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (router input, its weight) per forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append((x.detach().clone(), self.router.weight.detach().clone()))
        probs, _ = self.router(x)
        return self.dense(x) * probs.sum(-1).reshape(x.shape[:-1] + (1,)).to(x.dtype)


def _build(config):
    model = GPTModel(dataclasses.replace(config, num_moe_experts=None, moe_ffn_hidden_size=None))
    for key, layer in model.layers.items():
        if config.is_moe_layer(int(key)):
            layer.mlp = _RoutedMLP(layer.mlp, config, int(key))
    return model


def _initial_value(name, shape, config, seed):
    if name.endswith("router.weight"):
        return seeded_normal(canonical_parameter_name(name), shape, config.init_method_std * 20, seed)
    return gpt_initial_value(name, shape, config, seed)


@pytest.fixture
def family():
    return dataclasses.replace(get_family("gpt"), build_model=_build, initial_value=_initial_value)


def _trainer(family, *extra: str) -> Trainer:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    if "--train-iters" not in extra:
        extra = (*extra, "--train-iters", "1")
    return Trainer(parse_args([*ARGS, *extra]), family=family)


def _expected(router: TopKRouter, inputs, weight: float):
    """The router weight's gradient of (aux + z-loss) x weight summed over the micro-batches, and the
    tokens each expert got, from the written formulas."""
    grad, counts = torch.zeros_like(router.weight), torch.zeros(4)
    for x, w in inputs:
        w = w.clone().requires_grad_()
        logits = x.reshape(-1, 16) @ w.T
        t = logits.shape[0]
        scores = torch.sigmoid(logits)
        chosen = torch.zeros_like(scores).scatter(-1, scores.topk(2, dim=-1).indices, 1.0)
        counts += chosen.sum(0)
        normalised = scores / scores.sum(-1, keepdim=True)
        routed = torch.zeros_like(scores).scatter(-1, normalised.topk(2, dim=-1).indices, 1.0).sum(0)
        aux = 4 * 0.01 / (2 * t * t) * (normalised.sum(0) * routed).sum()
        z = 0.001 * (torch.logsumexp(logits, -1) ** 2).mean()
        (g,) = torch.autograd.grad((aux + z) * weight, w)
        grad += g
    return grad, counts


def test_aux_gradients_carry_the_micro_batch_weight_and_the_bias_moves(family):
    t = _trainer(family)
    try:
        mlp = t.module.layers["1"].mlp
        assert isinstance(t.module.layers["0"].mlp, nn.Module) and not hasattr(t.module.layers["0"].mlp, "router")
        t.train_step()
        assert len(mlp.inputs) == 3  # micro-batches
        grad, counts = _expected(mlp.router, mlp.inputs, 1 / 3)
        # the main loss adds nothing (the routed weights always sum to 1): the gradient is the losses'
        torch.testing.assert_close(mlp.router.weight.grad, grad, atol=1e-7, rtol=1e-4)
        torch.testing.assert_close(mlp.router.expert_bias, 0.01 * torch.sign(counts.mean() - counts))
        assert not mlp.router.local_tokens_per_expert.any()
    finally:
        t.close()


def test_log_line_and_tensorboard_show_the_moe_values(family, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = _trainer(family, "--train-iters", "4", "--log-interval", "2", "--tensorboard-dir", str(tmp_path / "tb"),
                 "--moe-per-layer-logging")
    try:
        t.train()
    finally:
        t.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "] iteration " in line]
    assert len(lines) == 2
    for line in lines:
        fields = parse_train_log_line(line)
        keys = list(fields)
        assert keys.index("lm loss") < keys.index("load_balancing_loss") < keys.index("z_loss") \
            < keys.index("loss scale")
        assert 0.5 < fields["load_balancing_loss"] < 2.0 and fields["z_loss"] > 0  # balanced: about 1
        number = r"\d\.\d{6}E[+-]\d\d"  # Megatron's {:.6E}
        assert re.search(rf" \| load_balancing_loss: {number} \| z_loss: {number} \| loss scale:", line)
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"load_balancing_loss", "z_loss", "moe/z_loss_layer_0", "moe/z_loss_layer_1",
            "moe/load_balancing_loss_layer_1"} <= tags
    layer0 = [e.value for e in ea.Scalars("moe/z_loss_layer_0")]
    layer1 = [e.value for e in ea.Scalars("moe/z_loss_layer_1")]
    mean = [e.value for e in ea.Scalars("z_loss")]
    assert len(mean) == 4 and layer0 == [0.0] * 4  # a dense layer; the mean is over the one MoE layer
    assert mean == pytest.approx(layer1)
    # the log line is the interval's mean of the iterations' values
    first = parse_train_log_line(lines[0])["z_loss"]
    assert first == pytest.approx(sum(mean[:2]) / 2, rel=1e-5)
