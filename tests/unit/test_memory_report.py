"""The theoretical memory report: parameter counts agree with the model, sharding shrinks it."""

from __future__ import annotations

import pytest
import torch

from megatrain.models.config import GPTConfig
from megatrain.models.gpt import GPTModel
from megatrain.training.memory_report import estimate_memory, parameter_counts

GPT2 = dict(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=256, max_position_embeddings=32)
LLAMA = dict(num_layers=3, hidden_size=64, num_attention_heads=8, num_query_groups=2, swiglu=True,
             ffn_hidden_size=96, position_embedding_type="rope", normalization="RMSNorm",
             untie_embeddings_and_output_weights=True, add_bias_linear=False, vocab_size=256,
             max_position_embeddings=32)


@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_parameter_count_matches_the_model(kw):
    cfg = GPTConfig(**kw)
    with torch.device("meta"):
        model = GPTModel(cfg)
    assert parameter_counts(cfg)[2] == model.num_parameters()


def test_bytes_per_parameter_and_sharding():
    cfg = GPTConfig(**GPT2)
    base = estimate_memory(cfg, seq_length=32, micro_batch_size=2, half_precision=True)
    n = base.parameters_rank
    assert base.weights_and_grads == 8 * n and base.optimizer == 8 * n and base.half_weights == 2 * n
    tp2 = estimate_memory(cfg, seq_length=32, micro_batch_size=2, tp=2)
    assert tp2.parameters_rank < n and tp2.activations < base.activations and tp2.logits == base.logits / 2
    z1 = estimate_memory(cfg, seq_length=32, micro_batch_size=2, dp=4, zero_stage=1)
    z3 = estimate_memory(cfg, seq_length=32, micro_batch_size=2, dp=4, zero_stage=3)
    assert z1.optimizer == base.optimizer / 4 and z3.half_weights < z1.half_weights
    full = estimate_memory(cfg, seq_length=32, micro_batch_size=2, recompute_granularity="full")
    assert full.activations < base.activations
    sp = estimate_memory(cfg, seq_length=32, micro_batch_size=2, tp=2, sequence_parallel=True)
    assert sp.activations < tp2.activations
    assert "total" in base.line() and f"{base.parameters_total:,}" in base.line()
