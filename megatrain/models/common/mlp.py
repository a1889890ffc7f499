"""The feed-forward block: GELU (GPT-2 style; exact or tanh-approximated) or SwiGLU (LLaMA style).

With SwiGLU, ``linear_fc1`` has 2F rows interleaved per channel: row 2i is gate channel i and
row 2i + 1 is up channel i, so an even row split across tensor-parallel ranks keeps each
channel's pair together. The forward reads the channel count from the tensor, never from F.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.models.common.config import TransformerConfig


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        assert config.ffn_hidden_size is not None
        h, ffn = config.hidden_size, config.ffn_hidden_size
        self.swiglu = config.swiglu
        self.gelu_approximation = config.gelu_approximation
        self.linear_fc1 = nn.Linear(h, 2 * ffn if self.swiglu else ffn, bias=config.add_bias_linear)
        self.linear_fc2 = nn.Linear(ffn, h, bias=config.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.swiglu:
            gate, up = y.unflatten(-1, (-1, 2)).unbind(-1)  # [..., F] each
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate=self.gelu_approximation)
        return self.linear_fc2(y)
