"""Megatron's vocabulary padding: the embedding has more rows than the tokenizer has tokens.

Here (below the trainer and the Hugging Face conversion) because both size the embedding with it:
the trainer from its tokenizer, the import from a Hugging Face folder, so that the two agree.
"""

from __future__ import annotations

import math

__all__ = ["padded_vocab_size"]


def padded_vocab_size(orig_vocab_size: int, make_vocab_size_divisible_by: int, tensor_parallel_size: int = 1) -> int:
    """Megatron's vocabulary padding: round up to a multiple of divisible_by * TP."""
    multiple = make_vocab_size_divisible_by * tensor_parallel_size
    return int(math.ceil(orig_vocab_size / multiple) * multiple)
