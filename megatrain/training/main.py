"""`megatrain pretrain`: parse Megatron-style flags and run pre-training."""

from __future__ import annotations

from megatrain.errors import user_errors_exit
from megatrain.training.arguments import parse_args
from megatrain.training.trainer import pretrain


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    pretrain(parse_args(argv))
