"""Pipeline stages of a T5Model: not supported, as in Megatron-LM (whose ``pretrain_t5.py`` refuses
``--pipeline-model-parallel-size`` > 1).

An encoder-decoder pipeline sends two tensors between decoder stages (the decoder's hidden states
and the whole encoder output, whose gradient every decoder stage adds to); megatrain's pipeline
passes one. ``pretrain_t5.py`` refuses the flag before anything is built; this entry of the family
says the same to a caller that asks for stages directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from megatrain.models.t5.config import T5Config

__all__ = ["build_stage", "PIPELINE_REFUSAL"]

PIPELINE_REFUSAL = ("--pipeline-model-parallel-size > 1 is not supported for T5 (as in Megatron-LM); use tensor, "
                    "sequence or data parallelism (--tensor-model-parallel-size, --sequence-parallel, "
                    "--use-distributed-optimizer)")


def build_stage(config: T5Config, layer_ids: Sequence[int], *, stage_index: int, num_stages: int) -> NoReturn:
    raise ValueError(PIPELINE_REFUSAL)
