"""`megatrain pretrain`: parse Megatron-style flags and run pre-training."""

from __future__ import annotations

from megatrain.errors import user_errors_exit
from megatrain.parallel.distributed import setup_env_from_slurm
from megatrain.training.arguments import parse_args
from megatrain.training.trainer import pretrain


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    # `srun python pretrain_gpt.py ...` (no torchrun): the ranks come from SLURM_* variables,
    # and the flags are checked against that world size.
    setup_env_from_slurm()
    pretrain(parse_args(argv))
