"""Typed configuration of the T5 model family (Megatron-LM's ``T5Model``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from megatrain.models.common.config import TransformerConfig, transformer_fields_from_args

__all__ = ["T5Config", "t5_config_from_args"]


@dataclass
class T5Config(TransformerConfig):
    """An encoder-decoder transformer: ``num_layers`` encoder layers (``--encoder-num-layers``, as
    Megatron's ``args.num_layers``) and ``decoder_num_layers`` decoder layers (default the same), of
    one shape, sharing one word (+ position) embedding with the output layer (unless untied).

    ``position_embedding_type`` "relative": T5's bucketed relative position bias,
    ``relative_attention_num_buckets`` buckets up to ``relative_attention_max_distance``, one table
    for the encoder and one for the decoder. ``decoder_seq_length`` is the decoder's input length
    (``--decoder-seq-length``): the FLOPs formula counts it; the weights do not depend on it.
    """

    decoder_num_layers: int | None = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    decoder_seq_length: int | None = None
    # The masks are explicit: encoder padding, decoder causal + padding, encoder padding for cross-attention.
    causal_attention: ClassVar[bool] = False
    position_embedding_types: ClassVar[tuple[str, ...]] = ("learned_absolute", "relative", "rope")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.decoder_num_layers is None:
            self.decoder_num_layers = self.num_layers
        if self.decoder_num_layers <= 0:
            raise ValueError(f"--decoder-num-layers must be positive, got {self.decoder_num_layers}")
        if self.num_query_groups != self.num_attention_heads:
            raise ValueError("--group-query-attention is not supported for T5: its cross-attention has one "
                             "key/value head per query head (as Megatron's CrossAttention)")
        if self.position_embedding_type == "relative":
            if self.relative_attention_num_buckets < 4:
                raise ValueError(f"--relative-attention-num-buckets must be at least 4, got "
                                 f"{self.relative_attention_num_buckets}")
            if self.relative_attention_max_distance <= self.relative_attention_num_buckets // 2:
                raise ValueError(f"--relative-attention-max-distance ({self.relative_attention_max_distance}) must "
                                 f"exceed half of --relative-attention-num-buckets "
                                 f"({self.relative_attention_num_buckets}): the exactly bucketed distances")
        if self.decoder_seq_length is not None and self.decoder_seq_length <= 0:
            raise ValueError(f"--decoder-seq-length must be positive, got {self.decoder_seq_length}")

    @property
    def decoder_layers(self) -> int:
        assert self.decoder_num_layers is not None
        return self.decoder_num_layers


def t5_config_from_args(args: argparse.Namespace, vocab_size: int) -> T5Config:
    """T5Config from Megatron-style flags (``pretrain_t5.py``, after ``prepare_t5_args`` filled
    ``--num-layers`` and ``--seq-length``); ``vocab_size`` is already padded."""
    return T5Config(**transformer_fields_from_args(args, vocab_size),
                    decoder_num_layers=getattr(args, "decoder_num_layers", None),
                    relative_attention_num_buckets=getattr(args, "relative_attention_num_buckets", 32),
                    relative_attention_max_distance=getattr(args, "relative_attention_max_distance", 128),
                    decoder_seq_length=getattr(args, "decoder_seq_length", None))
