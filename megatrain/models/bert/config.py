"""Typed configuration of the BERT model family (Megatron-LM's ``BertModel``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from megatrain.models.common.config import TransformerConfig

__all__ = ["BertConfig", "bert_config_from_args"]


@dataclass
class BertConfig(TransformerConfig):
    """A bidirectional transformer encoder with BERT's heads.

    ``add_binary_head``: the pooler (dense + tanh on ``[CLS]``) and the binary (sentence-order)
    head, and two token types (``--bert-no-binary-head`` turns all three off, as Megatron does);
    ``num_tokentypes`` is 2 with the binary head, else 0. The masked-LM head is Megatron's: dense,
    GELU, LayerNorm, then the output layer (tied to the word embeddings unless
    ``untie_embeddings_and_output_weights``) with a bias.
    """

    add_binary_head: bool = True
    num_tokentypes: int = 2
    causal_attention: ClassVar[bool] = False  # every position sees the whole sequence (its padding masked)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_tokentypes < 0:
            raise ValueError(f"the number of token types must be >= 0, got {self.num_tokentypes}")


def bert_config_from_args(args: argparse.Namespace, vocab_size: int) -> BertConfig:
    """BertConfig from Megatron-style flags (``pretrain_bert.py``); ``vocab_size`` is already padded."""
    fused_gelu = args.add_bias_linear and not getattr(args, "no_bias_gelu_fusion", False)
    binary_head = bool(getattr(args, "bert_binary_head", True))
    return BertConfig(
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
        # Megatron's fused bias-GELU computes the tanh approximation; --no-bias-gelu-fusion: exact
        gelu_approximation="tanh" if fused_gelu and not args.swiglu else "none",
        add_bias_linear=args.add_bias_linear,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        fp32_residual_connection=bool(getattr(args, "fp32_residual_connection", False)),
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        add_binary_head=binary_head,
        num_tokentypes=2 if binary_head else 0,
    )
