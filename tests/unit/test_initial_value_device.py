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


def test_threads_drawing_the_initial_values_give_the_model_its_one_set_of_weights():
    from megatrain.models.gpt.model import GPTModel
    from megatrain.parallel.parallelize import init_parameters

    cfg = GPTConfig(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=96,
                    max_position_embeddings=16)
    reference = GPTModel(cfg)
    reference.init_weights(seed=11)  # the whole model on one device, parameter by parameter
    for workers in (1, 4):
        with torch.device("meta"):
            model = GPTModel(cfg)
        model.to_empty(device="cpu")
        init_parameters(model, cfg, 11, workers=workers)
        for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
            assert torch.equal(a, b), (workers, name)


def test_values_come_in_order_with_few_bytes_waiting():
    import threading

    from megatrain.parallel.parallelize import _in_order

    waiting, most, lock = [0], [0], threading.Lock()

    def draw(n):
        with lock:
            waiting[0] += n
            most[0] = max(most[0], waiting[0])
        return torch.full((n,), float(n))

    sizes = [9, 1, 8, 2, 7, 3, 6, 4, 5]
    out = []
    for n, value in zip(sizes, _in_order(draw, sizes, 3, nbytes=lambda n: n, budget=10)):
        out.append(int(value[0]))
        with lock:
            waiting[0] -= n
    assert out == sizes
    assert most[0] <= 10  # drawn values not yet taken never held more than the budget
