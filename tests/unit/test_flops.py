"""FLOPs formula (GUIDE §3.4) against a hand count and torch's FLOP counter; peak table and MFU."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel
from megatrain.training.flops import (
    PEAK_TFLOPS,
    device_peak_tflops,
    mfu,
    num_floating_point_operations,
    peak_tflops_for_name,
    tflops_per_gpu,
)


def hand_count(B: int, s: int, h: int, L: int, n: int, g: int, d: int, F: int, V: int, swiglu: bool) -> float:
    """Forward matmuls listed one by one as (rows, inner, cols), each 2*rows*inner*cols FLOPs;
    backward is twice the forward. Causal attention computes half of each s x s score matrix."""
    tokens = B * s
    matmuls = []
    for _ in range(L):
        matmuls.append((tokens, h, n * d))  # queries
        matmuls.append((tokens, h, g * d))  # keys
        matmuls.append((tokens, h, g * d))  # values
        for _ in range(B * n):
            matmuls.append((s, d, s / 2))  # Q K^T, causal half
            matmuls.append((s / 2, s, d))  # scores x V, causal half
        matmuls.append((tokens, n * d, h))  # output projection
        if swiglu:
            matmuls.append((tokens, h, F))  # gate
            matmuls.append((tokens, h, F))  # up
        else:
            matmuls.append((tokens, h, F))  # fc1
        matmuls.append((tokens, F, h))  # fc2
    matmuls.append((tokens, h, V))  # logits
    forward = sum(2 * rows * inner * cols for rows, inner, cols in matmuls)
    return 3 * forward


@pytest.mark.parametrize("swiglu, groups", [(False, 4), (True, 2), (True, 1)])
def test_formula_matches_hand_count(swiglu, groups):
    cfg = GPTConfig(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=groups, kv_channels=6,
                    ffn_hidden_size=40, vocab_size=100, swiglu=swiglu)
    expected = hand_count(B=5, s=16, h=32, L=3, n=4, g=groups, d=6, F=40, V=100, swiglu=swiglu)
    assert num_floating_point_operations(cfg, batch_size=5, seq_length=16) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("swiglu", [False, True])
def test_linear_part_matches_torch_flop_counter(swiglu):
    """Counting the model's real forward + backward matmuls gives the formula without attention."""
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=50,
                    ffn_hidden_size=40, swiglu=swiglu, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg)
    tokens = torch.randint(0, 50, (3, 12))
    counter = FlopCounterMode(display=False)
    with counter:
        model(tokens, labels=tokens).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    measured = sum(v for op, v in counts.items() if str(op) in ("aten.mm", "aten.addmm"))
    attention = 6 * 3 * 12**2 * 2 * 4 * 8
    assert measured == num_floating_point_operations(cfg, 3, 12) - attention


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0),
        ("NVIDIA H200", torch.bfloat16, 989.0),
        ("NVIDIA H100 PCIe", torch.float16, 756.0),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
        ("NVIDIA A100 80GB PCIe", torch.bfloat16, 312.0),
        ("NVIDIA L40S", torch.bfloat16, 362.0),
        ("NVIDIA A10", torch.bfloat16, 125.0),
        ("NVIDIA A10G", torch.bfloat16, None),  # not "A10"
        ("Tesla V100-SXM2-32GB", torch.float16, 125.0),
        ("Tesla V100-SXM2-32GB", torch.bfloat16, None),
        ("NVIDIA H100 80GB HBM3", torch.float32, None),
        ("Some Future GPU", torch.bfloat16, None),
    ],
)
def test_peak_table_lookup(name, dtype, peak):
    assert peak_tflops_for_name(name, dtype) == peak


def test_peak_table_has_the_listed_devices():
    assert PEAK_TFLOPS["H100"] == PEAK_TFLOPS["H200"] == 989.0


def test_cpu_has_no_peak_and_mfu_is_none():
    assert device_peak_tflops("cpu", torch.bfloat16) is None
    assert device_peak_tflops(torch.device("cpu"), torch.float32) is None
    assert mfu(100.0, None) is None
    assert mfu(494.5, 989.0) == pytest.approx(0.5)


def test_tflops_per_gpu():
    assert tflops_per_gpu(8e15, iteration_seconds=2.0, world_size=4) == pytest.approx(1000.0)
