"""Typed configuration of the GPT model family (GPT-2 style by default, LLaMA style by flags)."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.models.common.config import TransformerConfig

__all__ = ["GPTConfig"]


@dataclass
class GPTConfig(TransformerConfig):
    """A decoder-only transformer: the shared transformer shape, causal attention, a language-model
    head (tied to the word embeddings unless ``untie_embeddings_and_output_weights``)."""
