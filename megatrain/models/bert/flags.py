"""The BERT family's own flags, with Megatron-LM's names, defaults and attribute names.

Everything else (model shape, dropout, training, parallelism, data, tokenizer) is the general
pre-training command line of ``pretrain_gpt.py``; ``pretrain_bert.py`` adds these to it:

* ``--bert-no-binary-head`` (``bert_binary_head``, default True): no pooler and sentence-order
  (binary) head, no token types, samples of one segment;
* ``--mask-prob`` (0.15): the fraction of tokens the masked-LM data masks;
* ``--short-seq-prob`` (0.1): the probability that a sample's target length is drawn shorter than
  ``--seq-length``.
"""

from __future__ import annotations

import argparse

from megatrain.flags import flag_section

__all__ = ["add_bert_flags", "BERT_FLAGS"]

# The flags only BERT-style data and models read (tools use them to tell a BERT command line).
BERT_FLAGS = ("--bert-no-binary-head", "--mask-prob", "--short-seq-prob")


def add_bert_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--bert-no-binary-head``, ``--mask-prob`` and ``--short-seq-prob`` to ``parser``."""
    g = flag_section(parser, "network size")
    g.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head",
                   help="BERT without the pooler and the binary (sentence-order) head")
    g = flag_section(parser, "data and dataloader")
    g.add_argument("--mask-prob", type=float, default=0.15,
                   help="probability of replacing a token with [MASK] (masked-LM data)")
    g.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="probability of producing a short sequence (masked-LM data)")
