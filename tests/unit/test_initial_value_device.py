"""initial_value is computed on the CPU whatever the default device, so a model built under
`with torch.device("cuda")` (or meta) gets the same weights as one built on the CPU."""

from __future__ import annotations

import torch

from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import initial_value


def test_initial_value_ignores_the_default_device():
    cfg = GPTConfig()
    names = ["layers.0.self_attention.linear_qkv.weight", "layers.0.input_layernorm.weight",
             "layers.0.mlp.linear_fc2.bias"]
    plain = [initial_value(n, (8, 4) if n.endswith("qkv.weight") else (4,), cfg, 7) for n in names]
    with torch.device("meta"):
        under_meta = [initial_value(n, (8, 4) if n.endswith("qkv.weight") else (4,), cfg, 7) for n in names]
    for a, b in zip(plain, under_meta):
        assert b.device.type == "cpu" and torch.equal(a, b)
