"""Checkpoint flags (``--save``, ``--load`` and what they keep, find and verify), with Megatron-LM's names.

`megatrain.checkpoint` and the trainer read them.
"""

from __future__ import annotations

import argparse

from megatrain.checkpoint.strictness import DEFAULT_STRICTNESS, STRICTNESS_MODES
from megatrain.flags import flag_section

__all__ = ["add_checkpoint_flags"]


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_checkpoint_flags(parser: argparse.ArgumentParser) -> None:
    """Add the ``checkpointing`` flags to ``parser``."""
    g = flag_section(parser, "checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None,
                   help="directory to load a checkpoint from; a Hugging Face model folder (config.json and weights; "
                        "explicitly: hf:DIR) starts from its weights at iteration 0, its config.json giving the model "
                        "flags (docs/convert.md)")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="start from this checkpoint (or Hugging Face folder) as --load DIR --finetune when --load "
                        "holds no checkpoint; --load wins when it does (resuming the run)")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load weights only; reset iteration and optimizer")
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: stop with an error when no checkpoint is found (default: start fresh)")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model configuration (every value a resume compares: layers, sizes, heads, "
                        "positions, norms, ...; a LLaVA checkpoint's ViT and projector flags too) from the --load "
                        "checkpoint instead of the flags; with no checkpoint there yet, the flags (as Megatron)")
    g.add_argument("--save-hf", action="store_true",
                   help="megatrain extension: with every checkpoint also write a Hugging Face copy into its "
                        "iter_XXXXXXX/hf/ folder (rank 0, once the checkpoint is complete, in a separate process)")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background; the loop waits only for a copy to host memory")
    g.add_argument("--keep-last-checkpoints", type=_at_least_one, default=None, metavar="K",
                   help="after each save delete all but the newest K complete checkpoints (default: keep all)")
    g.add_argument("--no-verify-checkpoint-checksums", action="store_true",
                   help="megatrain extension: on --load, check the files' sizes only, not their checksums "
                        "(verifying reads the whole checkpoint once)")
    g.add_argument("--dist-ckpt-strictness", default=DEFAULT_STRICTNESS, choices=STRICTNESS_MODES,
                   help="on --load, the model's tensors the checkpoint lacks (Megatron's \"unexpected\" keys) and the "
                        "checkpoint's tensors the model lacks (\"missing\"): raise_* refuses, log_* names them in "
                        "one line per kind and loads the rest (the model's keep their initial values), ignore_all "
                        "loads the rest silently, return_* logs as log_*; *_unexpected reads past the checkpoint's "
                        "extra tensors. The default assume_ok_unexpected refuses both kinds (Megatron's loader "
                        "reads past the extra ones: raise_unexpected), --finetune loads around both with a warning "
                        "(docs/checkpoints.md)")
    g.add_argument("--allow-non-finite-checkpoint", action="store_true",
                   help="megatrain extension: load a checkpoint whose model or optimizer state holds NaN/Inf "
                        "(refused by default)")
