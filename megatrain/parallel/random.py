"""Random-number handling for parallel runs: base seeds and dropout regions that differ per TP rank.

Megatron's rules, reproduced from outside the model:

* Every rank seeds its default generators with ``seed + 100 * pp_rank`` (``+ 10 * dp_rank`` with
  ``--data-parallel-random-init``). Tensor-parallel ranks therefore draw the same numbers, so
  dropout on *replicated* activations (the residual stream without sequence parallelism, the
  embeddings) agrees across them, as it must for the replicas to stay identical.
* Dropout on *sharded* activations must differ across tensor-parallel ranks, otherwise every
  shard would see the same mask: attention dropout (each rank holds its own heads) and, with
  sequence parallelism, the hidden dropout on the rank's part of the sequence. Such a region runs
  under :meth:`TensorParallelRNG.fork`, which draws one number from the default CPU generator
  (advancing it identically on all TP ranks), seeds the default generators with a value derived
  from that number and the TP rank, and restores them afterwards.

Deriving the forked seed from the default generator (instead of keeping a second, separately
advancing generator state like Megatron's tracker) makes the forked region replay exactly under
activation recomputation: ``torch.utils.checkpoint`` restores the default generators before it
recomputes, so the fork draws the same number again and reproduces the same masks.
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np
import torch
from torch import nn

_TP_SEED_OFFSET = 2718  # Megatron's offset of the model-parallel seed


def seed_everything(seed: int, *, pp_rank: int = 0, dp_rank: int = 0, data_parallel_random_init: bool = False) -> int:
    """Seed python, numpy and torch (all devices) the Megatron way; returns the seed used."""
    seed = seed + 100 * pp_rank
    if data_parallel_random_init:
        seed += 10 * dp_rank
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return seed


class TensorParallelRNG:
    """Forks the default generators into a per-TP-rank stream for sharded dropout regions."""

    def __init__(self, tp_rank: int, device: torch.device | str = "cpu") -> None:
        self.tp_rank = tp_rank
        self.device = torch.device(device)
        self._open: list[contextlib.ExitStack] = []

    def _derived_seed(self) -> int:
        draw = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())  # default CPU generator
        return (draw * 1_000_003 + _TP_SEED_OFFSET + self.tp_rank) % (2**63 - 1)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body with generators seeded per TP rank; restore them afterwards."""
        seed = self._derived_seed()
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type if devices else "cuda"):
            torch.default_generator.manual_seed(seed)
            if devices:
                with torch.cuda.device(self.device):
                    torch.cuda.manual_seed(seed)
            yield

    # Hooks so that a module's forward runs under fork() without touching the module's code.
    def _enter(self, module: nn.Module, args: tuple) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self.fork())
        self._open.append(stack)

    def _exit(self, module: nn.Module, args: tuple, output: object) -> None:
        self._open.pop().close()

    def fork_module(self, module: nn.Module) -> None:
        """Make every forward of ``module`` run under :meth:`fork` (forward pre/post hooks)."""
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._exit, always_call=True)
