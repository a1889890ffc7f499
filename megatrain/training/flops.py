"""FLOPs per training iteration (the model family's formula), the per-device peak table, and model
FLOPs utilisation (MFU). The GPT family's formula is in :mod:`megatrain.models.gpt.flops`.

A family whose iterations differ in cost (``ModelFamily.batch_flops``: LLaVA's images per sample)
has its training micro-batches counted as the loader gives them (:class:`CountedFlops`, on the
host: no device sync), and the log line divides what the interval's iterations ran."""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator

import torch

from megatrain.models.registry import family_of_config

# Dense (no sparsity) 16-bit tensor-core peak in TFLOP/s, keyed by a substring of the device name
# (torch.cuda.get_device_name). The longest matching key wins, so "H100 PCIe" beats "H100".
PEAK_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "GH200": 989.0,
    "H100": 989.0,  # SXM
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10": 125.0,
    "V100": 125.0,  # fp16 only: V100 has no bf16 tensor cores
}
_FP16_ONLY = frozenset({"V100"})


def num_floating_point_operations(cfg: Any, batch_size: int, seq_length: int) -> float:
    """Model FLOPs of one iteration over ``batch_size`` sequences of ``seq_length`` tokens (the
    family of ``cfg`` gives the formula)."""
    return family_of_config(cfg).flops(cfg, batch_size, seq_length)


class CountedFlops:
    """An iterator of training micro-batches (``batches``) that adds up ``count(micro_batch)``, each
    micro-batch's FLOPs as the loader gives it, until :meth:`take`."""

    def __init__(self, batches: Iterator[Any], count: Callable[[Any], float]):
        self._batches, self._count = batches, count
        self.flops = 0.0

    def __iter__(self) -> "CountedFlops":
        return self

    def __next__(self) -> Any:
        batch = next(self._batches)
        self.flops += float(self._count(batch))
        return batch

    def take(self) -> float:
        """The FLOPs of the micro-batches read since the last call."""
        flops, self.flops = self.flops, 0.0
        return flops


def tflops_per_gpu(flops: float, iteration_seconds: float, world_size: int) -> float:
    """Achieved TFLOP/s per GPU, as Megatron logs it."""
    return flops / (iteration_seconds * 1e12 * world_size)


def peak_tflops_for_name(device_name: str, dtype: torch.dtype) -> float | None:
    """Peak TFLOP/s of the device called ``device_name`` for ``dtype``, or None if unknown."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        # Whole-token match: "A10" must not match "A100" or "A10G", "H200" not "GH200".
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name):
            if dtype == torch.bfloat16 and key in _FP16_ONLY:
                return None
            return PEAK_TFLOPS[key]
    return None


def device_peak_tflops(device: torch.device | str, dtype: torch.dtype) -> float | None:
    """Peak TFLOP/s of a CUDA device for ``dtype``; None for CPUs, fp32 and unknown GPUs."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_tflops_for_name(torch.cuda.get_device_name(device), dtype)


def mfu(tflops_per_gpu: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction of ``peak`` (None when the peak is unknown)."""
    if peak is None or peak <= 0:
        return None
    return tflops_per_gpu / peak
