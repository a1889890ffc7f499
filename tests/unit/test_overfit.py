"""Tiny GPT-2 style and LLaMA style models memorise a fixed batch: the whole training path learns."""

from __future__ import annotations

import time

import pytest
import torch

from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel

COMMON = dict(num_layers=2, vocab_size=32, max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)
CONFIGS = {
    "gpt2": GPTConfig(hidden_size=32, num_attention_heads=4, **COMMON),
    "llama": GPTConfig(hidden_size=32, num_attention_heads=4, num_query_groups=2, position_embedding_type="rope",
                       normalization="RMSNorm", swiglu=True, ffn_hidden_size=64, add_bias_linear=False,
                       untie_embeddings_and_output_weights=True, **COMMON),
}


@pytest.mark.parametrize("style", CONFIGS)
def test_overfits_a_fixed_batch(style):
    torch.manual_seed(0)
    model = GPTModel(CONFIGS[style])
    model.init_weights(seed=1)
    model.train()
    data = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(2))
    tokens, labels = data[:, :-1], data[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)

    start = time.perf_counter()
    first = None
    for _ in range(300):
        loss = model(tokens, labels=labels).mean()
        first = loss.item() if first is None else first
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if loss.item() < 0.05:
            break
    assert first > 3.0  # about ln(32) at the start
    assert loss.item() < 0.05, f"{style}: loss {loss.item():.3f} after training"
    assert time.perf_counter() - start < 15.0
