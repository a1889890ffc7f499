"""``MoELayer``: the MLP of a mixture-of-experts transformer layer (Megatron-LM's ``MoELayer`` with
its ``SharedExpertMLP``), assembled from the router, a token dispatcher and the grouped experts.

Module paths (a contract with initialisation, tensor/expert parallel plans, checkpoints, conversion)::

    mlp.router                 TopKRouter: weight [E, h] (+ expert_bias [E] buffer)
    mlp.dispatcher             LocalDispatcher (no parameters; expert parallelism replaces it)
    mlp.experts.linear_fc1/2   GroupedExperts' [E, ...] weights
    mlp.shared_experts         SharedExpertMLP (--moe-shared-expert-intermediate-size): an MLP of
                               width S, linear_fc1 / linear_fc2 as the dense MLP's, and with
                               --moe-shared-expert-gate its gate_weight [1, h]

Forward, as Megatron's: shared experts on the layer input, routing, dispatch, experts, combine, and the
routed sum plus the shared output. The routed sum is in the experts' output dtype (bf16 under
autocast); the router's weights multiply the expert outputs in their own dtype (fp32 with
``--moe-router-dtype fp32``) and the sum is cast back, as Megatron's un-permute does.

Parallelism: each rank routes the tokens it holds. Under sequence parallelism the layer input is this
rank's part of the sequence (the tensor-parallel plan gathers nothing for a MoE layer's ``mlp``); the
shared experts gather the sequence in their ``linear_fc1`` (column parallel) and reduce-scatter it back
in ``linear_fc2`` (row parallel), so their output is this rank's part again.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.models.common.mlp import MLP
from megatrain.models.common.moe.dispatcher import LocalDispatcher
from megatrain.models.common.moe.experts import GroupedExperts, local_tensor
from megatrain.models.common.moe.router import TopKRouter

__all__ = ["MoELayer", "SharedExpertMLP"]


class SharedExpertMLP(MLP):
    """The shared experts every token passes through: the dense :class:`MLP` with width
    ``moe_shared_expert_intermediate_size`` (no biases, as Megatron), optionally gated per token by
    ``sigmoid(x @ gate_weight^T)``."""

    def __init__(self, config: Any) -> None:
        width = config.moe_shared_expert_intermediate_size
        assert width is not None
        if config.add_bias_linear:
            raise ValueError("--moe-shared-expert-intermediate-size: the shared experts have no biases (as in "
                             "Megatron-LM); give --disable-bias-linear")
        shared = copy.copy(config)  # the dense MLP reads its width from the config
        shared.ffn_hidden_size = width
        super().__init__(shared)
        self.gate_weight: nn.Parameter | None = None
        if config.moe_shared_expert_gate:
            self.gate_weight = nn.Parameter(torch.empty(1, config.hidden_size))
            if not self.gate_weight.is_meta:
                with torch.no_grad():
                    self.gate_weight.normal_(0.0, config.init_method_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate_weight is not None:
            # Under sequence parallelism x and gate_weight are DTensors (the plan's gate style), so the
            # gate weight's gradient sums the ranks' parts of the sequence; the score is this rank's.
            score = local_tensor(torch.sigmoid(F.linear(x, self.gate_weight)))
            out = local_tensor(out) * score
        return out


class MoELayer(nn.Module):
    """Router + dispatcher + routed experts (+ shared experts): ``forward(x [b, s, h]) -> [b, s, h]``.
    ``layer_number``: the layer's 0-based index in the model (the router logs under it)."""

    def __init__(self, config: Any, layer_number: int = 0) -> None:
        super().__init__()
        if config.num_moe_experts is None:
            raise ValueError("a MoE layer needs --num-experts")
        self.layer_number = layer_number
        self.router = TopKRouter(config, layer_number)
        self.dispatcher: nn.Module = LocalDispatcher(config)
        self.experts = GroupedExperts(config)
        self.shared_experts: SharedExpertMLP | None = (
            SharedExpertMLP(config) if config.moe_shared_expert_intermediate_size is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        probs, routing_map = self.router(x)
        tokens = x.reshape(-1, shape[-1])
        expert_input, tokens_per_expert = self.dispatcher.dispatch(tokens, probs, routing_map)
        expert_output = self.experts(expert_input, tokens_per_expert)
        out = self.dispatcher.combine(expert_output).reshape(shape)
        if shared is not None:
            out = out + shared
        return out
