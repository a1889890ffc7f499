"""KV-cache decoding and batched generation, checked against full recomputation."""

from __future__ import annotations

import pytest
import torch

from megatrain.inference.generation import KVCache, generate, sample_next_tokens
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel

VOCAB = 64


def make_model(style: str, **overrides) -> GPTModel:
    """A tiny GPT-2-style or LLaMA-style model (``overrides``: other GPTConfig fields)."""
    common = dict(num_layers=2, vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout=0.0,
                  attention_dropout=0.0, init_method_std=0.3)
    common.update(overrides)
    if style == "gpt2":
        config = GPTConfig(hidden_size=32, num_attention_heads=4, **common)
    else:
        config = GPTConfig(hidden_size=48, num_attention_heads=6, num_query_groups=2, position_embedding_type="rope",
                           normalization="RMSNorm", swiglu=True, ffn_hidden_size=64, add_bias_linear=False,
                           untie_embeddings_and_output_weights=True, **common)
    model = GPTModel(config)
    model.init_weights(seed=11)
    return model.eval()


STYLES = ["gpt2", "llama"]
PROMPTS = [[5, 17, 3, 9, 22, 40, 1], [8, 2], [30, 31, 32, 33]]


def reference_greedy(model: GPTModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by re-running the whole sequence at every step (no cache, no padding)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([tokens]))
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("style", STYLES)
def test_kv_cache_logits_equal_full_forward(style):
    model = make_model(style)
    tokens = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(max_length=12)
        pieces = [model(tokens[:, :5], kv_cache=cache)]  # prefill
        pieces.append(model(tokens[:, 5:8], kv_cache=cache))  # several tokens after a filled cache
        for t in range(8, 12):  # then one at a time
            pieces.append(model(tokens[:, t : t + 1], kv_cache=cache))
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-4)  # fp32, different kernels


def test_kv_cache_overflow_is_an_error():
    model = make_model("gpt2")
    cache = KVCache(max_length=4)
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="KV cache is full"):
            model(torch.zeros(1, 2, dtype=torch.long), kv_cache=cache)


@pytest.mark.parametrize("style", STYLES)
def test_greedy_equals_full_recompute_argmax(style):
    model = make_model(style)
    for prompt in PROMPTS:
        out = generate(model, [prompt], max_new_tokens=8)
        assert out == [reference_greedy(model, prompt, 8)]
    assert len(set(out[0])) > 1, "the test model should not be degenerate"


@pytest.mark.parametrize("style", STYLES)
def test_batch_of_different_lengths_equals_one_at_a_time(style):
    model = make_model(style)
    batched = generate(model, PROMPTS, max_new_tokens=8)
    alone = [generate(model, [p], max_new_tokens=8)[0] for p in PROMPTS]
    assert batched == alone
    assert batched == [reference_greedy(model, p, 8) for p in PROMPTS]


def test_generate_restores_training_mode():
    model = make_model("gpt2").train()
    generate(model, [[1, 2]], max_new_tokens=2)
    assert model.training


def test_eod_stops_only_that_sequence():
    model = make_model("llama")
    free = generate(model, PROMPTS, max_new_tokens=8)
    eod = free[0][2]  # the third token sequence 0 produces
    stopped = generate(model, PROMPTS, max_new_tokens=8, eod=eod)
    for full, short in zip(free, stopped):
        cut = full.index(eod) + 1 if eod in full else len(full)
        assert short == full[:cut]
    assert len(stopped[0]) <= 3


def test_stop_token_sequence():
    model = make_model("gpt2")
    free = generate(model, [PROMPTS[0]], max_new_tokens=8)[0]
    stop = free[3:5]
    out = generate(model, [PROMPTS[0]], max_new_tokens=8, stop_token_sequences=[stop])[0]
    first = next(i for i in range(len(free) - 1) if free[i : i + 2] == stop)
    assert out == free[: first + 2]


@pytest.mark.parametrize("style", STYLES)
def test_top_k_one_equals_greedy(style):
    model = make_model(style)
    greedy = generate(model, PROMPTS, max_new_tokens=6)
    assert generate(model, PROMPTS, max_new_tokens=6, greedy=False, top_k=1, temperature=0.7, seed=1) == greedy
    assert generate(model, PROMPTS, max_new_tokens=6, greedy=False, top_p=1e-6, seed=1) == greedy


def test_seed_makes_sampling_reproducible():
    model = make_model("llama")
    kwargs = dict(max_new_tokens=12, greedy=False, temperature=1.5)
    first = generate(model, PROMPTS, seed=1234, **kwargs)
    assert generate(model, PROMPTS, seed=1234, **kwargs) == first
    assert generate(model, PROMPTS, seed=99, **kwargs) != first


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)
    generator = torch.Generator().manual_seed(0)
    top2 = sample_next_tokens(logits, greedy=False, top_k=2, generator=generator)
    assert set(top2.tolist()) == {0, 1}
    # Probabilities are about 0.64, 0.24, 0.09, ...: top_p=0.8 keeps the first two tokens.
    nucleus = sample_next_tokens(logits, greedy=False, top_p=0.8, generator=generator)
    assert set(nucleus.tolist()) == {0, 1}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_k=5), "greedy"),
        (dict(greedy=False, temperature=0.0), "temperature"),
        (dict(greedy=False, top_p=1.5), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
    ],
)
def test_bad_arguments(kwargs, message):
    model = make_model("gpt2")
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(model, [[1, 2]], **kwargs)


def test_too_long_for_learned_positions():
    model = make_model("gpt2")  # max_position_embeddings=64
    with pytest.raises(ValueError, match="--max-position-embeddings"):
        generate(model, [[1] * 60], max_new_tokens=10)
    assert len(generate(model, [[1] * 60], max_new_tokens=5)[0]) == 5  # positions up to 63 fit
