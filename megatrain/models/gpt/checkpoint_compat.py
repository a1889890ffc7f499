"""The GPT family's checkpoint checks: how each `GPTConfig` field is compared between a
checkpoint and the flags (docs/checkpoints.md has the same table), and the GELU a checkpoint
was trained with.

A unit test fails when a `GPTConfig` field has no entry here.
"""

from __future__ import annotations

from typing import Any

from megatrain.models.common.config_checks import TRANSFORMER_CONFIG_CHECKS, ConfigCheck
from megatrain.models.gpt.config import GPTConfig

__all__ = ["CONFIG_CHECKS", "checkpoint_gelu_approximation"]

# Every GPTConfig field is a TransformerConfig field: the shared table is the GPT family's.
CONFIG_CHECKS: dict[str, ConfigCheck] = dict(TRANSFORMER_CONFIG_CHECKS)


def checkpoint_gelu_approximation(model_config: dict[str, Any]) -> str:
    """The GELU a checkpoint's model was trained with (the `GPTConfig` default, exact GELU, for
    checkpoints from before the choice existed)."""
    return str(model_config.get("gelu_approximation", GPTConfig.gelu_approximation))
