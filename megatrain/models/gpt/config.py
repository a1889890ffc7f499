"""Typed configuration of the GPT model family (GPT-2 style by default, LLaMA style by flags)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from megatrain.models.common.config import (TransformerConfig, gelu_approximation_from_args,
                                             transformer_fields_from_args)

__all__ = ["GPTConfig", "gpt_config_from_args", "gelu_approximation_from_args"]


@dataclass
class GPTConfig(TransformerConfig):
    """A decoder-only transformer: the shared transformer shape, causal attention, a language-model
    head (tied to the word embeddings unless ``untie_embeddings_and_output_weights``)."""

    supports_mla: ClassVar[bool] = True
    supports_mtp: ClassVar[bool] = True


def gpt_config_from_args(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    """GPTConfig from Megatron-style flags; ``vocab_size`` is already padded."""
    return GPTConfig(**transformer_fields_from_args(args, vocab_size))
