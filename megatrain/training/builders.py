"""Turning parsed arguments into the objects a run needs: padded vocab, precision, device (the model
config comes from the model family: ``ModelFamily.config_from_args``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from megatrain.models.common.vocab import padded_vocab_size

__all__ = ["Precision", "choose_device", "padded_vocab_size"]


@dataclass
class Precision:
    """Compute dtype of a run: parameters stay fp32 (master weights), matmuls run in ``dtype``."""

    dtype: torch.dtype

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Precision":
        if args.bf16:
            return cls(torch.bfloat16)
        if args.fp16:
            return cls(torch.float16)
        return cls(torch.float32)

    @property
    def name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]

    def autocast(self, device: torch.device):
        """Autocast context for the forward pass (a no-op for fp32)."""
        if self.dtype == torch.float32:
            return torch.autocast(device_type=device.type, enabled=False)
        return torch.autocast(device_type=device.type, dtype=self.dtype)


def choose_device(requested: str | None, local_rank: int = 0) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available (or requested), else cpu."""
    if requested == "cpu":
        return torch.device("cpu")
    if requested and requested.startswith("cuda") or (requested is None and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda was given but CUDA is not available")
        return torch.device("cuda", local_rank)
    if requested not in (None, "cpu"):
        raise SystemExit(f"error: --device must be cpu or cuda, got {requested!r}")
    return torch.device("cpu")
