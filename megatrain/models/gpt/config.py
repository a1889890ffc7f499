"""Typed configuration of the GPT model family (GPT-2 style by default, LLaMA style by flags)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatrain.models.common.config import TransformerConfig

__all__ = ["GPTConfig", "gpt_config_from_args", "gelu_approximation_from_args"]


@dataclass
class GPTConfig(TransformerConfig):
    """A decoder-only transformer: the shared transformer shape, causal attention, a language-model
    head (tied to the word embeddings unless ``untie_embeddings_and_output_weights``)."""


def gelu_approximation_from_args(args: argparse.Namespace) -> str:
    """Megatron-LM's GELU: with linear biases its default fused bias-GELU computes the tanh
    approximation; ``--no-bias-gelu-fusion`` (or no biases) gives exact GELU."""
    fused = getattr(args, "add_bias_linear", True) and not getattr(args, "no_bias_gelu_fusion", False)
    return "tanh" if fused and not args.swiglu else "none"


def gpt_config_from_args(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    """GPTConfig from Megatron-style flags; ``vocab_size`` is already padded."""
    return GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        apply_layernorm_1p=bool(getattr(args, "apply_layernorm_1p", False)),
        normalization=args.normalization,
        norm_epsilon=args.norm_epsilon,
        swiglu=args.swiglu,
        gelu_approximation=gelu_approximation_from_args(args),
        add_bias_linear=args.add_bias_linear,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        fp32_residual_connection=bool(getattr(args, "fp32_residual_connection", False)),
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
    )
