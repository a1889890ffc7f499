"""The LLaVA family's projector: vision features [.., vision hidden x feature layers] -> the language
model's hidden size. ``mlp`` is Linear-GELU-Linear (LLaVA 1.5, Hugging Face's
``LlavaMultiModalProjector``: ``linear_1``, ``linear_2``); ``affine`` one Linear (LLaVA 1.0).
Megatron's ``MultimodalProjector`` names: ``linear_fc1`` (and ``linear_fc2``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.models.common.init import canonical_parameter_name, seeded_normal
from megatrain.models.llava.config import LlavaConfig

__all__ = ["MultimodalProjector", "projector_initial_value"]


class MultimodalProjector(nn.Module):
    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.projector_type = config.projector_type
        h_in, h_out = config.projector_input_size, config.language.hidden_size
        if config.projector_type == "mlp":
            ffn = config.projector_ffn_hidden_size
            assert ffn is not None
            self.linear_fc1 = nn.Linear(h_in, ffn, bias=config.projector_bias)
            self.linear_fc2: nn.Linear | None = nn.Linear(ffn, h_out, bias=config.projector_bias)
        else:  # affine
            self.linear_fc1 = nn.Linear(h_in, h_out, bias=config.projector_bias)
            self.linear_fc2 = None

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        hidden = self.linear_fc1(features)
        if self.linear_fc2 is None:
            return hidden
        return self.linear_fc2(F.gelu(hidden))  # exact GELU (Hugging Face's projector_hidden_act "gelu")


def projector_initial_value(name: str, shape: Sequence[int], config: LlavaConfig, seed: int) -> torch.Tensor:
    """Weights N(0, the language model's init_method_std), biases 0."""
    canonical = canonical_parameter_name(name)
    if canonical.endswith(".bias"):
        return torch.zeros(tuple(shape))
    if canonical.endswith(".weight"):
        return seeded_normal(canonical, shape, config.language.init_method_std, seed)
    raise ValueError(f"no initialisation rule for parameter {name!r}")
