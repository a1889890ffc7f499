"""`megatrain pretrain` / `pretrain-bert` / `pretrain-t5` / `pretrain-vlm`: parse Megatron-style flags
and run pre-training of a model family (``pretrain_gpt.py``, ``pretrain_bert.py``, ``pretrain_t5.py``,
``pretrain_vlm.py``)."""

from __future__ import annotations

import argparse
from typing import Sequence

from megatrain.errors import user_errors_exit
from megatrain.models.registry import DEFAULT_FAMILY, get_family
from megatrain.parallel.distributed import setup_env_from_slurm
from megatrain.training.arguments import build_parser, parse_args, validate_args
from megatrain.training.finetune import SFTTrainer, check_sft_args
from megatrain.training.trainer import pretrain

__all__ = ["main", "main_bert", "main_t5", "main_vlm", "family_parser", "parse_family_args"]


def family_parser(family: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The general pre-training parser plus the family's own flags and defaults (its script's)."""
    fam = get_family(family)
    parser = build_parser(prog=prog or fam.script or f"pretrain_{family}.py")
    parser.description = f"Pre-train {fam.description or family} with Megatron-LM compatible flags."
    if fam.add_flags is not None:
        fam.add_flags(parser)
    if fam.flag_defaults:
        parser.set_defaults(**fam.flag_defaults)
    return parser


def parse_family_args(family: str, argv: Sequence[str] | None = None, *, prog: str | None = None,
                      validate: bool = True) -> argparse.Namespace:
    """Parse and validate a family's command line: its own flags fill the general ones they stand for
    (``prepare_args``), then the general checks (with the family's config), then the family's own."""
    fam = get_family(family)
    prog = prog or fam.script or None
    args = parse_args(argv, parser=family_parser(family, prog), validate=False)
    if getattr(args, "sft", False):
        raise SystemExit(f"error: --sft trains GPT models on chat conversations: use pretrain_gpt.py, not "
                         f"{prog or f'pretrain_{family}.py'}")
    if not validate:
        return args
    try:
        if fam.prepare_args is not None:
            fam.prepare_args(args)
        validate_args(args, config_from_args=fam.config_from_args)
        if fam.check_args is not None:
            fam.check_args(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return args


def _run(family: str, argv: list[str] | None, prog: str | None) -> None:
    # `srun python pretrain_gpt.py ...` (no torchrun): the ranks come from SLURM_* variables,
    # and the flags are checked against that world size.
    setup_env_from_slurm()
    if family == DEFAULT_FAMILY:
        args = parse_args(argv)
        if args.sft:  # Megatron's SFT conversations (pretrain_gpt.py's dataset switch)
            check_sft_args(args, "pretrain_gpt.py")
            pretrain(args, trainer_class=SFTTrainer)
        else:
            pretrain(args)
    else:
        pretrain(parse_family_args(family, argv, prog=prog), family=family)


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    """``pretrain_gpt.py``."""
    _run(DEFAULT_FAMILY, argv, None)


@user_errors_exit
def main_bert(argv: list[str] | None = None) -> None:
    """``pretrain_bert.py``."""
    _run("bert", argv, "pretrain_bert.py")


@user_errors_exit
def main_t5(argv: list[str] | None = None) -> None:
    """``pretrain_t5.py``."""
    _run("t5", argv, "pretrain_t5.py")


@user_errors_exit
def main_vlm(argv: list[str] | None = None) -> None:
    """``pretrain_vlm.py`` (and ``examples/multimodal/train.py``): the LLaVA family."""
    _run("llava", argv, "pretrain_vlm.py")
