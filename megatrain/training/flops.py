"""FLOPs per training iteration, the per-device peak table, and model FLOPs utilisation (MFU).

The FLOPs count is Megatron-LM's model FLOPs (forward + backward, no recomputation), with
B global batch, s sequence length, h hidden, L layers, n heads, g query groups, d head dim,
F ffn hidden, V padded vocabulary and E = 3 with SwiGLU (fc1 is twice as wide) else 2:

    FLOPs = B*s*[6*h*E*F*L + 6*L*(h*d*(n+2g) + d*n*h) + 6*h*V] + 6*B*s^2*L*n*d

Every matmul costs 2*m*k*n forward and twice that backward (gradients of input and weight),
hence the 6. The last term is causal attention: QK^T and attention x V over half of the s x s
score matrix.
"""

from __future__ import annotations

import re

import torch

from megatrain.models.gpt.config import GPTConfig

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


def num_floating_point_operations(cfg: GPTConfig, batch_size: int, seq_length: int) -> float:
    """Model FLOPs of one iteration over ``batch_size`` sequences of ``seq_length`` tokens."""
    assert cfg.ffn_hidden_size is not None and cfg.kv_channels is not None and cfg.num_query_groups is not None
    B, s = batch_size, seq_length
    h, L, V = cfg.hidden_size, cfg.num_layers, cfg.vocab_size
    n, g, d, F = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels, cfg.ffn_hidden_size
    E = 3 if cfg.swiglu else 2
    per_token = 6 * h * E * F * L + 6 * L * (h * d * (n + 2 * g) + d * n * h) + 6 * h * V
    attention = 6 * B * s * s * L * n * d
    return float(B * s * per_token + attention)


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
