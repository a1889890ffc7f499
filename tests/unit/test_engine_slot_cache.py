"""The engine's slot KV cache and model runner against the model run on whole sequences (no cache)."""

from __future__ import annotations

import pytest
import torch

from megatrain.inference.engine.runner import ModelRunner, buckets_up_to
from megatrain.inference.engine.slot_cache import CacheShape, SlotKVCache
from megatrain.models.common.attention import SelfAttention
from megatrain.models.gpt import GPTModel

from tests.unit.test_generation import VOCAB, make_model  # noqa: F401 (the same tiny models)


def make_runner(model: GPTModel, max_requests: int = 4, max_len: int = 32, packed: str = "segments") -> ModelRunner:
    layers = tuple(m.layer_number for m in model.modules() if isinstance(m, SelfAttention))
    shape = CacheShape(layers, model.config.num_query_groups, model.config.kv_channels, max_requests, max_len)
    return ModelRunner(model, SlotKVCache(shape, torch.float32, torch.device("cpu"), packed_attention=packed),
                       torch.device("cpu"), cuda_graphs=False)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@torch.no_grad()
def test_prefill_then_decode_of_several_slots_equals_whole_sequences(style):
    model = make_model(style)
    runner = make_runner(model)
    prompts = {0: [5, 17, 3, 9, 22], 2: [8, 2], 1: [30, 31, 32, 33, 34, 35, 36]}
    for slot, prompt in prompts.items():
        (last,) = runner.prefill([(slot, prompt)])
        torch.testing.assert_close(last, model(torch.tensor([prompt]))[0, -1], rtol=1e-5, atol=1e-5)
    sequences = {slot: list(p) for slot, p in prompts.items()}
    for step in range(3):  # slot 3 is padding (scratch position); slots grow at their own positions
        tokens = [(7 * slot + step) % VOCAB for slot in range(3)] + [0]
        positions = [len(sequences[slot]) for slot in range(3)] + [runner.scratch_position]
        for slot in range(3):
            sequences[slot].append(tokens[slot])
        logits = runner.decode(tokens, positions, max(positions[:3]) + 1)
        for slot in range(3):
            expected = model(torch.tensor([sequences[slot]]))[0, -1]
            torch.testing.assert_close(logits[slot], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", ["segments", "mask"])
@pytest.mark.parametrize("window", [None, (2, 0)])
@torch.no_grad()
def test_packed_prefill_equals_prompts_alone(window, packed):
    model = make_model("llama", window_size=window)
    runner = make_runner(model, packed=packed)
    items = [(2, [5, 17, 3, 9, 22]), (0, [8]), (1, [30, 31, 32, 33])]
    last = runner.prefill(items)
    for (slot, prompt), row in zip(items, last):
        torch.testing.assert_close(row, model(torch.tensor([prompt]))[0, -1], rtol=1e-5, atol=1e-5)
    for slot, prompt in items:  # and each slot holds its own prompt's keys: decode one token on all three
        prompt.append(7)
    logits = runner.decode([7, 7, 7], [len(items[1][1]) - 1, len(items[2][1]) - 1, len(items[0][1]) - 1], 6)
    for slot, prompt in items:
        torch.testing.assert_close(logits[slot], model(torch.tensor([prompt]))[0, -1], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_sliding_window_decode_equals_whole_sequence():
    model = make_model("llama", window_size=(3, 0))
    runner = make_runner(model)
    sequence = [4, 8, 15, 16, 23, 42]
    runner.prefill([(1, sequence)])
    for token in [1, 2, 3]:
        position = len(sequence)
        sequence.append(token)
        logits = runner.decode([0, token], [runner.scratch_position, position], position + 1)
        torch.testing.assert_close(logits[1], model(torch.tensor([sequence]))[0, -1], rtol=1e-5, atol=1e-5)


def test_cache_is_preallocated_and_checks_its_limits():
    model = make_model("llama")
    runner = make_runner(model, max_requests=3, max_len=16)
    cache = runner.cache
    # 2 layers x (keys + values) x [3 slots, 2 groups, 16 positions, 8 dims] x 4 bytes
    assert cache.nbytes == 2 * 2 * 3 * 2 * 16 * 8 * 4
    with pytest.raises(ValueError, match="does not fit"):
        cache.begin_prefill([0], [17])
    with pytest.raises(ValueError, match="slot 3"):
        cache.begin_prefill([3], [4])


def test_buckets():
    assert buckets_up_to(16, (1, 2, 4, 8, 16, 32, 64)) == (1, 2, 4, 8, 16)
    assert buckets_up_to(12, (1, 2, 4, 8, 16, 32, 64)) == (1, 2, 4, 8, 12)
    runner = make_runner(make_model("gpt2"), max_requests=12, max_len=1000)
    runner.length_buckets = (256, 512, 1000)
    assert runner.bucket(3, 10) == (4, 256)
    assert runner.bucket(9, 700) == (12, 1000)


@pytest.mark.long  # a CPU compilation: ~25 s
@torch.no_grad()
def test_compiled_packed_prefill_equals_eager_across_pack_shapes():
    """compile_prefill: one compilation with a dynamic token count serves packs of other sizes and
    prompt counts; the logits and the stored keys equal the eager prefill's."""
    model = make_model("llama")
    eager = make_runner(model, packed="mask")
    layers = tuple(m.layer_number for m in model.modules() if isinstance(m, SelfAttention))
    shape = CacheShape(layers, model.config.num_query_groups, model.config.kv_channels, 4, 32)
    compiled = ModelRunner(model, SlotKVCache(shape, torch.float32, torch.device("cpu"), packed_attention="mask"),
                           torch.device("cpu"), cuda_graphs=False, compile_prefill=True)
    for items in ([(2, [5, 17, 3, 9, 22]), (0, [8]), (1, [30, 31, 32, 33])],
                  [(3, [1, 2, 3, 4, 5, 6, 7]), (1, [9, 9])], [(0, [4, 3, 2])]):
        torch.testing.assert_close(compiled.prefill(items), eager.prefill(items), rtol=1e-5, atol=1e-5)
        for n in layers:
            for slot, prompt in items:
                torch.testing.assert_close(compiled.cache.keys[n][slot, :, :len(prompt)],
                                           eager.cache.keys[n][slot, :, :len(prompt)], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="packed_attention='mask'"):
        ModelRunner(model, SlotKVCache(shape, torch.float32, torch.device("cpu")), torch.device("cpu"),
                    cuda_graphs=False, compile_prefill=True)
