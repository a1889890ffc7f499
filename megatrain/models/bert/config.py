"""Typed configuration of the BERT model family (Megatron-LM's ``BertModel``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from megatrain.models.common.config import TransformerConfig, transformer_fields_from_args

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
    supports_moe: ClassVar[bool] = False  # --num-experts is refused (no MoE layers in BERT)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_tokentypes < 0:
            raise ValueError(f"the number of token types must be >= 0, got {self.num_tokentypes}")


def bert_config_from_args(args: argparse.Namespace, vocab_size: int) -> BertConfig:
    """BertConfig from Megatron-style flags (``pretrain_bert.py``); ``vocab_size`` is already padded."""
    binary_head = bool(getattr(args, "bert_binary_head", True))
    return BertConfig(**transformer_fields_from_args(args, vocab_size), add_binary_head=binary_head,
                      num_tokentypes=2 if binary_head else 0)
