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


def megatron_mla_flops(B, s, *, h, L, n, P, R, V, C, Q, F, vocab, dense_layers, moe_layers, moe_ffn, topk,
                       shared):
    """Megatron-LM's ``num_floating_point_operations`` (megatron/training/training.py, its
    ``multi_latent_attention`` branch, SwiGLU, BSHD, no MTP) written out term by term."""
    if Q is None:
        q_term = h * n * (P + R)
    else:
        q_term = Q * (h + n * (P + R) + 1)
    self_attn_term = 3 * 2 * (q_term + C * (h + n * (P + V) + 1) + h * R + (n * V) * h)
    self_attn_core_term = 3 * 2 * (n * (P + R) / 2 + n * V / 2)
    mlp = 3 * 2 * h * ((F * 3) * dense_layers + (moe_ffn * topk * 3) * moe_layers + (shared * 3) * moe_layers)
    logits = 3 * 2 * h * vocab * 1
    return (B * s) * (mlp + self_attn_term * L + logits) + (B * s * s) * (self_attn_core_term * L)


DEEPSEEK_V3 = dict(num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432,
                   vocab_size=129280, max_position_embeddings=4096, swiglu=True, normalization="RMSNorm",
                   add_bias_linear=False, position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                   multi_latent_attention=True, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
                   v_head_dim=128, qk_layernorm=True, rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                   num_moe_experts=256, moe_ffn_hidden_size=2048, moe_router_topk=8,
                   moe_shared_expert_intermediate_size=2048, moe_layer_freq=[0] * 3 + [1] * 58)


@pytest.mark.parametrize("q_lora_rank", [1536, None], ids=["q_lora", "no_q_lora"])
def test_mla_formula_is_megatrons(q_lora_rank):
    """DeepSeek-V3's shape (3 dense layers, 58 MoE layers): exactly Megatron's MLA count."""
    cfg = GPTConfig(**DEEPSEEK_V3, q_lora_rank=q_lora_rank)
    assert cfg.num_moe_layers == 58
    for B, s in ((1, 4096), (3, 1000)):
        want = megatron_mla_flops(B, s, h=7168, L=61, n=128, P=128, R=64, V=128, C=512, Q=q_lora_rank, F=18432,
                                  vocab=129280, dense_layers=3, moe_layers=58, moe_ffn=2048, topk=8, shared=2048)
        assert num_floating_point_operations(cfg, batch_size=B, seq_length=s) == want


def test_mla_formula_by_hand_numbers():
    """A small MLA shape counted by hand: per token and layer q 16*4*(6+4) = 640 (no --q-lora-rank) or
    12*(16+40+1) = 684, kv 8*(16+4*(6+5)+1) = 488, rope keys 16*4 = 64, output 4*5*16 = 320; core
    6*(4*10/2 + 4*5/2) = 180 per s^2; MLP 6*16*2*24 = 4608; logits 6*16*64 = 6144."""
    kw = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24, vocab_size=64,
              max_position_embeddings=32, position_embedding_type="rope", multi_latent_attention=True,
              kv_lora_rank=8, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5)
    B, s = 2, 8
    for q, q_term in ((None, 640), (12, 684)):
        cfg = GPTConfig(**kw, q_lora_rank=q)
        per_token = 2 * (4608 + 6 * (q_term + 488 + 64 + 320)) + 6144
        assert num_floating_point_operations(cfg, B, s) == B * s * per_token + B * s * s * 2 * 180
