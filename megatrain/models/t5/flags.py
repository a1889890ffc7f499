"""The T5 family's own flags, with Megatron-LM's names, defaults and attribute names.

Everything else (model shape, dropout, training, parallelism, data, tokenizer) is the general
pre-training command line of ``pretrain_gpt.py``; ``pretrain_t5.py`` adds these to it:

* ``--encoder-num-layers`` / ``--decoder-num-layers``: the two stacks (``--num-layers`` gives both;
  Megatron allows ``--num-layers`` or ``--encoder-num-layers``, not both);
* ``--encoder-seq-length`` (``--seq-length`` is its alias, again one or the other) and
  ``--decoder-seq-length``: the encoder's and the decoder's input lengths;
* ``--relative-attention-num-buckets`` (32) and ``--relative-attention-max-distance`` (128): T5's
  relative position bias, with ``--position-embedding-type relative`` (which this script adds to the
  choices learned_absolute and rope);
* ``--mask-prob`` (0.15) and ``--short-seq-prob`` (0.1): the span-corruption data's masking
  fraction and the probability of a shorter target length.
"""

from __future__ import annotations

import argparse

from megatrain.flags import flag_section

__all__ = ["add_t5_flags", "T5_FLAGS"]

# The flags only T5 reads (pretrain_gpt.py points to pretrain_t5.py for them).
T5_FLAGS = ("--encoder-num-layers", "--decoder-num-layers", "--encoder-seq-length", "--decoder-seq-length",
            "--relative-attention-num-buckets", "--relative-attention-max-distance")


def add_t5_flags(parser: argparse.ArgumentParser) -> None:
    """Add T5's flags to ``parser`` (the general pre-training parser) and the ``relative`` position type."""
    g = flag_section(parser, "network size")
    g.add_argument("--encoder-num-layers", type=int, default=None,
                   help="encoder transformer layers (or --num-layers)")
    g.add_argument("--decoder-num-layers", type=int, default=None,
                   help="decoder transformer layers (default: as many as the encoder)")
    g.add_argument("--relative-attention-num-buckets", type=int, default=32,
                   help="buckets of the relative position bias (--position-embedding-type relative)")
    g.add_argument("--relative-attention-max-distance", type=int, default=128,
                   help="distance up to which the relative position buckets grow")
    for action in parser._actions:  # the general flag, with T5's third kind of positions
        if action.dest == "position_embedding_type":
            action.choices = [*action.choices, "relative"]
            action.help = "learned_absolute, rope, or relative (T5's bucketed relative position bias)"
    g = flag_section(parser, "data and dataloader")
    g.add_argument("--encoder-seq-length", type=int, default=None,
                   help="encoder input length (or --seq-length)")
    g.add_argument("--decoder-seq-length", type=int, default=None, help="decoder input length")
    g.add_argument("--mask-prob", type=float, default=0.15,
                   help="fraction of the encoder tokens that span corruption masks")
    g.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="probability of producing a shorter sample")
