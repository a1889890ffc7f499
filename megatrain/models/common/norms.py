"""Normalisation layers: LayerNorm (GPT-2 style) or RMSNorm (LLaMA style), chosen by --normalization.

With ``--apply-layernorm-1p`` the weight is stored centred on zero and the layer scales by
``1 + weight`` (Megatron's zero-centred gamma): the same function, a weight that weight decay and
low precision treat more kindly. Its parameters keep the names of the plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.models.common.config import TransformerConfig


class LayerNorm1P(nn.LayerNorm):
    """LayerNorm whose scale is ``1 + weight``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """RMSNorm that computes in its weight's dtype: with float32 weights under autocast, a bf16/fp16
    residual stream is normalised in float32 with a float32 result, as autocast does for LayerNorm
    (and torch's fused kernel takes it; it refuses mixed input/weight dtypes)."""

    def scale(self) -> torch.Tensor:
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.to(self.weight.dtype), self.normalized_shape, self.scale(), self.eps)


class RMSNorm1P(RMSNorm):
    """RMSNorm whose scale is ``1 + weight``."""

    def scale(self) -> torch.Tensor:
        return self.weight + 1


def build_norm(config: TransformerConfig, width: int | None = None) -> nn.Module:
    """The normalisation layer the config asks for, over the last dim of size ``width`` (default h).

    LayerNorm has a weight and a bias; RMSNorm has only a weight (as in Megatron and LLaMA).
    """
    width = config.hidden_size if width is None else width
    if config.normalization == "LayerNorm":
        return (LayerNorm1P if config.apply_layernorm_1p else nn.LayerNorm)(width, eps=config.norm_epsilon)
    if config.normalization == "RMSNorm":
        return (RMSNorm1P if config.apply_layernorm_1p else RMSNorm)(width, eps=config.norm_epsilon)
    raise ValueError(f"--normalization must be LayerNorm or RMSNorm, got {config.normalization!r}")
