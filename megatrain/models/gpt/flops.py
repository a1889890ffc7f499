"""FLOPs of one GPT training iteration: Megatron-LM's transformer formula
(:mod:`megatrain.models.common.flops`), with causal attention counted over half the score matrix;
mixture-of-experts layers count their top-k routed experts and shared experts, as Megatron's."""

from __future__ import annotations

from megatrain.models.common.flops import transformer_flops
from megatrain.models.gpt.config import GPTConfig

__all__ = ["num_floating_point_operations"]


def num_floating_point_operations(cfg: GPTConfig, batch_size: int, seq_length: int) -> float:
    """Model FLOPs of one iteration over ``batch_size`` sequences of ``seq_length`` tokens."""
    return transformer_flops(cfg, batch_size, seq_length)
