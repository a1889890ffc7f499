"""The GPT family's registry entry.

Minimal for now: the config class, the model, its initialisation rules and its checkpoint checks
are the family's own; the other entries (flags, pipeline stage, TP plan, objective, FLOPs) still
live with their callers and are not reached through the registry yet.
"""

from __future__ import annotations

from typing import Any

from megatrain.models.gpt.checkpoint_compat import CONFIG_CHECKS
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt.model import GPTModel, initial_value
from megatrain.models.registry import ModelFamily, register

__all__ = ["GPT"]


def _not_here(what: str) -> Any:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"the GPT family's {what} is not reached through the registry yet")
    return missing


GPT = register(ModelFamily(
    name="gpt",
    config_class=GPTConfig,
    config_from_args=_not_here("config_from_args"),
    build_model=GPTModel,
    build_stage=_not_here("build_stage"),
    initial_value=initial_value,
    tensor_parallel_plan=_not_here("tensor_parallel_plan"),
    objective=_not_here("objective"),
    flops=_not_here("flops"),
    config_checks=CONFIG_CHECKS,
    description="decoder-only transformers, GPT-2 style by default and LLaMA style by flags",
))
