"""The GPT family's registry entry: what the trainer, pipeline, checkpoints and converters use."""

from __future__ import annotations

from typing import Any

from megatrain.models.gpt.hf import ADAPTER
from megatrain.models.gpt.checkpoint_compat import CONFIG_CHECKS
from megatrain.models.gpt.config import GPTConfig, gpt_config_from_args
from megatrain.models.gpt.flops import num_floating_point_operations
from megatrain.models.gpt.memory import estimate_memory
from megatrain.models.gpt.model import GPTModel, initial_value
from megatrain.models.gpt.objective import CausalLMObjective
from megatrain.models.gpt.plan import tensor_parallel_plan
from megatrain.models.gpt.stage import GPTStage
from megatrain.models.registry import ModelFamily, register

__all__ = ["GPT"]


def _objective(args: Any, tokenizer: Any) -> CausalLMObjective:
    return CausalLMObjective.from_args(args, tokenizer)


GPT = register(ModelFamily(
    name="gpt",
    config_class=GPTConfig,
    config_from_args=gpt_config_from_args,
    build_model=GPTModel,
    build_stage=GPTStage,
    initial_value=initial_value,
    tensor_parallel_plan=tensor_parallel_plan,
    objective=_objective,
    flops=num_floating_point_operations,
    memory=estimate_memory,
    config_checks=CONFIG_CHECKS,
    hf=ADAPTER,
    description="decoder-only transformers: GPT-2 style by default, LLaMA style by flags",
))
