"""FLOPs of one BERT training iteration: Megatron-LM's transformer formula
(:mod:`megatrain.models.common.flops`), the formula Megatron's BERT runs log with (it leaves out the
masked-LM transform, the pooler and the binary head, and counts attention at half its
bidirectional cost, so TFLOP/s figures compare with Megatron's own)."""

from __future__ import annotations

from megatrain.models.bert.config import BertConfig
from megatrain.models.common.flops import transformer_flops

__all__ = ["num_floating_point_operations"]


def num_floating_point_operations(cfg: BertConfig, batch_size: int, seq_length: int) -> float:
    return transformer_flops(cfg, batch_size, seq_length)
