"""Whether megatrain's Triton kernels can run here: Triton installed, and the tensors on CUDA (or on
any device under Triton's interpreter, ``TRITON_INTERPRET=1``, how the CPU tests run them).

Decided once at import, as plain constants: ``torch.compile`` traces :func:`kernel_available`
without guards on imports. ``TRITON_INTERPRET`` must therefore be set before megatrain is imported.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["kernel_available"]

_HAS_TRITON = importlib.util.find_spec("triton") is not None
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def kernel_available(device: torch.device) -> bool:
    """Whether a Triton kernel can run for tensors on ``device``."""
    return _HAS_TRITON and (device.type == "cuda" or _INTERPRETED)
