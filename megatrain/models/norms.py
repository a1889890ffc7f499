"""Normalisation layers: LayerNorm (GPT-2 style) or RMSNorm (LLaMA style), chosen by --normalization."""

from __future__ import annotations

from torch import nn

from megatrain.models.config import GPTConfig


def build_norm(config: GPTConfig, width: int | None = None) -> nn.Module:
    """The normalisation layer the config asks for, over the last dim of size ``width`` (default h).

    LayerNorm has a weight and a bias; RMSNorm has only a weight (as in Megatron and LLaMA).
    """
    width = config.hidden_size if width is None else width
    if config.normalization == "LayerNorm":
        return nn.LayerNorm(width, eps=config.norm_epsilon)
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(width, eps=config.norm_epsilon)
    raise ValueError(f"--normalization must be LayerNorm or RMSNorm, got {config.normalization!r}")
