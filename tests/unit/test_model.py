"""GPTModel: shapes, parameter counts, weight layouts, initialisation, masks, RoPE, config errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatrain.models.common.attention import SelfAttention
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel, initial_value
from megatrain.models.common.mlp import MLP
from megatrain.models.common.rope import apply_rotary, rotary_cos_sin


def gpt2_config(**overrides) -> GPTConfig:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=96, max_position_embeddings=64,
                  hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(overrides)
    return GPTConfig(**fields)


def llama_config(**overrides) -> GPTConfig:
    fields = dict(num_layers=2, hidden_size=48, num_attention_heads=6, num_query_groups=2, vocab_size=96,
                  max_position_embeddings=64, position_embedding_type="rope", normalization="RMSNorm",
                  swiglu=True, ffn_hidden_size=80, add_bias_linear=False, untie_embeddings_and_output_weights=True,
                  hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(overrides)
    return GPTConfig(**fields)


STYLES = {"gpt2": gpt2_config, "llama": llama_config}
# Qwen2 (--disable-bias-linear --add-qkv-bias) and Qwen3 (--qk-layernorm, --kv-channels apart from h / n)
FEATURES = {"qkv_bias": dict(add_qkv_bias=True), "qk_layernorm": dict(qk_layernorm=True, kv_channels=10),
            "both": dict(add_qkv_bias=True, qk_layernorm=True, kv_channels=12)}


def count_parameters_formula(config: GPTConfig) -> int:
    """Parameter count written out from the architecture, independent of the model code."""
    h, L, V, F_ = config.hidden_size, config.num_layers, config.vocab_size, config.ffn_hidden_size
    n, g, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    bias = config.add_bias_linear
    norm = 2 * h if config.normalization == "LayerNorm" else h
    qkv = h * (n + 2 * g) * d + ((bias or config.add_qkv_bias) and (n + 2 * g) * d)
    qk_norms = (2 * d if config.normalization == "LayerNorm" else d) * 2 * config.qk_layernorm
    proj = n * d * h + (bias and h)
    fc1_out = 2 * F_ if config.swiglu else F_
    fc1 = h * fc1_out + (bias and fc1_out)
    fc2 = F_ * h + (bias and h)
    layer = 2 * norm + qkv + qk_norms + proj + fc1 + fc2
    embeddings = V * h + (config.max_position_embeddings * h if config.position_embedding_type == "learned_absolute" else 0)
    output = V * h if config.untie_embeddings_and_output_weights else 0
    return embeddings + L * layer + norm + output


# ---- shapes and counts --------------------------------------------------------------------------

@pytest.mark.parametrize("style", STYLES)
def test_logits_and_loss_shapes(style):
    config = STYLES[style]()
    model = GPTModel(config)
    tokens = torch.randint(0, config.vocab_size, (3, 11))
    logits = model(tokens)
    assert logits.shape == (3, 11, config.vocab_size)
    loss = model(tokens, labels=tokens)
    assert loss.shape == (3, 11) and loss.dtype == torch.float32
    expected = F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="none").view(3, 11)
    torch.testing.assert_close(loss, expected)


def test_loss_is_float32_for_bf16_model():
    model = GPTModel(gpt2_config()).to(torch.bfloat16)
    tokens = torch.randint(0, 96, (2, 5))
    assert model(tokens, labels=tokens).dtype == torch.float32


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("untie", [False, True])
def test_parameter_count_matches_formula(style, untie):
    config = STYLES[style](untie_embeddings_and_output_weights=untie)
    model = GPTModel(config)
    assert model.num_parameters() == count_parameters_formula(config)
    embeddings = config.vocab_size * config.hidden_size * (2 if untie else 1)
    if config.position_embedding_type == "learned_absolute":
        embeddings += config.max_position_embeddings * config.hidden_size
    assert model.num_parameters(exclude_embeddings=True) == count_parameters_formula(config) - embeddings


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("style", STYLES)
def test_parameter_count_with_qkv_bias_and_qk_layernorm(style, feature):
    config = STYLES[style](**FEATURES[feature], add_bias_linear=False)
    model = GPTModel(config)
    assert model.num_parameters() == count_parameters_formula(config)
    attention = model.layers["0"].self_attention
    assert (attention.linear_qkv.bias is not None) == config.add_qkv_bias  # QKV only, as Megatron's
    assert attention.linear_proj.bias is None and model.layers["0"].mlp.linear_fc2.bias is None
    names = {n for n, _ in model.named_parameters()}
    assert ("layers.1.self_attention.q_layernorm.weight" in names) == config.qk_layernorm
    assert ("layers.1.self_attention.k_layernorm.weight" in names) == config.qk_layernorm


def test_tied_output_uses_word_embeddings():
    model = GPTModel(gpt2_config())
    assert model.output_layer is None
    assert not any(k.startswith("output_layer") for k in model.state_dict())
    tokens = torch.randint(0, 96, (2, 7))
    hidden = model.embed(tokens, torch.arange(7)[None])
    for layer in model.layers.values():
        hidden = layer(hidden)
    expected = model.final_layernorm(hidden) @ model.embedding.word_embeddings.weight.T
    torch.testing.assert_close(model(tokens), expected)


def test_untied_output_layer_is_separate():
    model = GPTModel(gpt2_config(untie_embeddings_and_output_weights=True))
    assert model.output_layer is not None and model.output_layer.bias is None
    assert model.output_layer.weight.data_ptr() != model.embedding.word_embeddings.weight.data_ptr()
    tokens = torch.randint(0, 96, (2, 7))
    before = model(tokens)
    with torch.no_grad():
        model.output_layer.weight.mul_(2.0)
    torch.testing.assert_close(model(tokens), 2 * before)


def test_layers_are_keyed_by_number_and_no_buffers():
    model = GPTModel(llama_config(num_layers=3))
    assert list(model.layers.keys()) == ["0", "1", "2"]
    assert list(model.buffers()) == []
    assert set(model.state_dict()) == {name for name, _ in model.named_parameters()}
    assert "layers.2.self_attention.linear_qkv.weight" in model.state_dict()
    assert "embedding.position_embeddings.weight" not in model.state_dict()
    assert "embedding.position_embeddings.weight" in GPTModel(gpt2_config()).state_dict()


# ---- initialisation -----------------------------------------------------------------------------

def test_init_statistics():
    config = gpt2_config(num_layers=8, hidden_size=128, num_attention_heads=4, init_method_std=0.02)
    model = GPTModel(config)
    layer = model.layers["3"]
    qkv_std = layer.self_attention.linear_qkv.weight.std().item()
    proj_std = layer.self_attention.linear_proj.weight.std().item()
    fc2_std = layer.mlp.linear_fc2.weight.std().item()
    assert qkv_std == pytest.approx(0.02, rel=0.05)
    assert proj_std == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
    assert fc2_std == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
    assert model.embedding.word_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(layer.self_attention.linear_qkv.bias == 0)
    assert torch.all(layer.input_layernorm.weight == 1) and torch.all(layer.input_layernorm.bias == 0)


def test_init_is_deterministic_and_layout_independent():
    config = llama_config()
    a, b = GPTModel(config), GPTModel(config)
    torch.manual_seed(123)  # the global RNG must not matter
    a.init_weights(seed=7)
    b.init_weights(seed=7)
    with torch.device("meta"):
        c = GPTModel(config)
    assert c.embedding.word_embeddings.weight.is_meta
    c.to_empty(device="cpu")
    c.init_weights(seed=7)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa, pc), name
    # A different seed changes every random tensor; different parameters differ from each other.
    a.init_weights(seed=8)
    assert not torch.equal(a.layers["0"].mlp.linear_fc1.weight, b.layers["0"].mlp.linear_fc1.weight)
    assert not torch.equal(b.layers["0"].mlp.linear_fc1.weight, b.layers["1"].mlp.linear_fc1.weight)


def test_initial_value_ignores_wrapper_names():
    config = gpt2_config()
    name = "layers.1.self_attention.linear_proj.weight"
    plain = initial_value(name, (32, 32), config, seed=3)
    for wrapped in ("module.layers.1.self_attention.linear_proj.weight",
                    "_orig_mod.layers.1._checkpoint_wrapped_module.self_attention.linear_proj.weight"):
        assert torch.equal(initial_value(wrapped, (32, 32), config, seed=3), plain)
    assert plain.dtype == torch.float32 and plain.device.type == "cpu"
    with pytest.raises(ValueError, match="no initialisation rule"):
        initial_value("layers.0.mystery.weight", (2, 2), config, seed=3)


# ---- weight layouts -----------------------------------------------------------------------------

def reference_attention(attention: SelfAttention, x: torch.Tensor, n: int, g: int, d: int) -> torch.Tensor:
    """Causal attention with a separate q/k/v projection per head, sliced from Megatron's layout."""
    hpg = n // g
    w = attention.linear_qkv.weight.view(g, hpg + 2, d, -1)
    b = attention.linear_qkv.bias.view(g, hpg + 2, d)
    s = x.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    heads = []
    for group in range(g):
        k = x @ w[group, hpg].T + b[group, hpg]
        v = x @ w[group, hpg + 1].T + b[group, hpg + 1]
        for i in range(hpg):
            q = x @ w[group, i].T + b[group, i]
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
            scores = scores.masked_fill(~causal, float("-inf"))
            heads.append(scores.softmax(-1) @ v)
    return attention.linear_proj(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("groups", [1, 2, 6])
def test_grouped_qkv_layout_matches_per_head_reference(groups):
    config = gpt2_config(hidden_size=48, num_attention_heads=6, num_query_groups=groups, kv_channels=5)
    attention = SelfAttention(config, layer_number=0)
    with torch.no_grad():
        attention.linear_qkv.bias.normal_()
    x = torch.randn(2, 9, 48)
    torch.testing.assert_close(attention(x), reference_attention(attention, x, 6, groups, 5))


@pytest.mark.parametrize("groups", [1, 2])
def test_qk_layernorm_and_qkv_bias_match_written_out_reference(groups):
    """Megatron's --qk-layernorm: RMSNorm (eps --norm-epsilon, one weight of width d for all query
    heads, one for all key heads) over each head's query and key, then RoPE; --add-qkv-bias without
    the other biases. Written out per head from the [g, n/g + 2, d] rows."""
    n, d, h, eps, base = 4, 6, 16, 1e-5, 500.0
    config = llama_config(hidden_size=h, num_attention_heads=n, num_query_groups=groups, kv_channels=d,
                          add_qkv_bias=True, qk_layernorm=True, norm_epsilon=eps, rotary_base=base)
    attention = SelfAttention(config, layer_number=0)
    with torch.no_grad():
        for p in attention.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 7, h)
    positions = torch.arange(7)

    def rms(t, w):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(t):  # [b, s, d]: pair i with i + d/2, angle p * base^(-2i/d)
        theta = positions[:, None].float() * base ** (-torch.arange(0, d, 2).float() / d)  # [s, d/2]
        a, b = t[..., : d // 2], t[..., d // 2:]
        return torch.cat([a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()], dim=-1)

    hpg = n // groups
    w = attention.linear_qkv.weight.view(groups, hpg + 2, d, h)
    bias = attention.linear_qkv.bias.view(groups, hpg + 2, d)
    wq, wk = attention.q_layernorm.weight, attention.k_layernorm.weight
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    heads = []
    for group in range(groups):
        k = rope(rms(x @ w[group, hpg].T + bias[group, hpg], wk))
        v = x @ w[group, hpg + 1].T + bias[group, hpg + 1]
        for i in range(hpg):
            q = rope(rms(x @ w[group, i].T + bias[group, i], wq))
            scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~causal, float("-inf"))
            heads.append(scores.softmax(-1) @ v)
    expected = torch.cat(heads, dim=-1) @ attention.linear_proj.weight.T
    torch.testing.assert_close(attention(x, positions[None]), expected)


def test_qk_layernorm_with_layernorm_1p_is_the_same_function():
    plain = GPTModel(llama_config(qk_layernorm=True)).eval()
    centred = GPTModel(llama_config(qk_layernorm=True, apply_layernorm_1p=True)).eval()
    assert torch.equal(centred.layers["0"].self_attention.q_layernorm.weight, torch.zeros(8))
    with torch.no_grad():
        for (name, p), (_, c) in zip(plain.named_parameters(), centred.named_parameters()):
            p.add_(torch.randn_like(p) * 0.1)
            c.copy_(p - 1 if name.endswith("layernorm.weight") else p)
    tokens = torch.randint(0, 96, (2, 9))
    torch.testing.assert_close(centred(tokens), plain(tokens))


@pytest.mark.parametrize("flags,expected", [([], (False, False)), (["--add-qkv-bias"], (True, False)),
                                            (["--qk-layernorm", "--kv-channels", "12"], (False, True))])
def test_megatron_flags_qkv_bias_and_qk_layernorm(flags, expected):
    from megatrain.training.arguments import parse_args
    from megatrain.models.gpt.config import gpt_config_from_args
    args = parse_args(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
                       "--max-position-embeddings", "8", "--micro-batch-size", "1", "--mock-data",
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--train-iters", "1", "--lr", "1e-3",
                       "--disable-bias-linear", *flags])
    config = gpt_config_from_args(args, 128)
    assert (config.add_qkv_bias, config.qk_layernorm) == expected
    if "--kv-channels" in flags:
        assert config.kv_channels == 12 and GPTModel(config).layers["0"].self_attention.linear_proj.in_features == 48


@pytest.mark.parametrize("window", [(2, 0), (0, 0), (3, -1), (-1, 0)])
@pytest.mark.parametrize("groups", [1, 3])
def test_sliding_window_matches_written_out_reference(window, groups):
    """--window-size LEFT,RIGHT (Megatron's, as Transformer Engine and flash attention): query i sees
    keys i - LEFT ... i, causally (RIGHT changes nothing in a decoder); -1 unbounded."""
    config = gpt2_config(hidden_size=48, num_attention_heads=6, num_query_groups=groups, window_size=window)
    attention = SelfAttention(config, layer_number=0)
    with torch.no_grad():
        attention.linear_qkv.bias.normal_()
    x = torch.randn(2, 9, 48)
    n, d, hpg = 6, 8, 6 // groups
    w = attention.linear_qkv.weight.view(groups, hpg + 2, d, -1)
    b = attention.linear_qkv.bias.view(groups, hpg + 2, d)
    left = window[0] if window[0] >= 0 else 10**9
    allowed = torch.tensor([[i - left <= j <= i for j in range(9)] for i in range(9)])
    heads = []
    for group in range(groups):
        k, v = x @ w[group, hpg].T + b[group, hpg], x @ w[group, hpg + 1].T + b[group, hpg + 1]
        for i in range(hpg):
            q = x @ w[group, i].T + b[group, i]
            scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
            heads.append(scores.softmax(-1) @ v)
    torch.testing.assert_close(attention(x), attention.linear_proj(torch.cat(heads, dim=-1)))


def test_sliding_window_with_kv_cache_and_explicit_mask():
    from megatrain.models.common.attention import KVCache
    model = GPTModel(llama_config(window_size=(3, 0))).eval()
    tokens = torch.randint(0, 96, (2, 12))
    full = model(tokens)
    cache = KVCache(12)
    steps = [model(tokens[:, :5], kv_cache=cache)] + [model(tokens[:, t:t + 1], kv_cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)
    # an explicit (packed-document) mask is intersected with the window
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(model(tokens, attention_mask=causal), full)
    bias = torch.zeros(1, 1, 12, 12).masked_fill(~causal, float("-inf"))
    torch.testing.assert_close(model(tokens, attention_mask=bias), full)
    assert not torch.allclose(GPTModel(llama_config()).eval()(tokens)[:, 6:], full[:, 6:])  # the window matters


@pytest.mark.parametrize("window", [(1,), (2, -2), (1.5, 0), [True, 0]])
def test_bad_window_size(window):
    with pytest.raises(ValueError, match="--window-size must be two integers"):
        gpt2_config(window_size=window)


def test_window_size_flag_and_checkpoint_list():
    from megatrain.training.arguments import parse_args
    from megatrain.models.gpt.config import gpt_config_from_args
    base = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
            "--max-position-embeddings", "8", "--micro-batch-size", "1", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "64", "--train-iters", "1", "--lr", "1e-3"]
    assert gpt_config_from_args(parse_args(base + ["--window-size", "4095,0"]), 128).window_size == (4095, 0)
    assert gpt_config_from_args(parse_args(base), 128).window_size is None
    with pytest.raises(SystemExit):
        parse_args(base + ["--window-size", "4095"])
    assert gpt2_config(window_size=[7, 0]).window_size == (7, 0)  # as meta.json gives it back


def test_swiglu_fc1_rows_interleave_gate_and_up():
    mlp = MLP(llama_config())
    x = torch.randn(3, 4, 48)
    w1 = mlp.linear_fc1.weight
    gate, up = x @ w1[0::2].T, x @ w1[1::2].T
    torch.testing.assert_close(mlp(x), (F.silu(gate) * up) @ mlp.linear_fc2.weight.T)


@pytest.mark.parametrize("approximation", ["none", "tanh"])
def test_gelu_mlp_is_exact_gelu_or_its_tanh_approximation(approximation):
    config = gpt2_config()
    config.gelu_approximation = approximation
    mlp = MLP(config)
    x = torch.randn(3, 4, 32) * 3
    hidden = x @ mlp.linear_fc1.weight.T + mlp.linear_fc1.bias
    if approximation == "none":
        expected = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))
    else:  # the formula of Megatron-LM's fused bias-GELU and GPT-2's gelu_new
        expected = 0.5 * hidden * (1 + torch.tanh(math.sqrt(2 / math.pi) * (hidden + 0.044715 * hidden**3)))
    torch.testing.assert_close(mlp(x), expected @ mlp.linear_fc2.weight.T + mlp.linear_fc2.bias)


@pytest.mark.parametrize("flags,expected", [([], "tanh"), (["--no-bias-gelu-fusion"], "none"),
                                            (["--disable-bias-linear"], "none"), (["--swiglu"], "none")])
def test_megatron_flags_choose_the_gelu(flags, expected):
    """Megatron-LM's default fused bias-GELU computes the tanh approximation; without it, or without
    biases, exact GELU."""
    from megatrain.training.arguments import parse_args
    from megatrain.models.gpt.config import gpt_config_from_args as model_config_from_args
    args = parse_args(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
                       "--max-position-embeddings", "8", "--micro-batch-size", "1", "--mock-data",
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--train-iters", "1", "--lr", "1e-3", *flags])
    assert model_config_from_args(args, 128).gelu_approximation == expected


@pytest.mark.parametrize("style", STYLES)
def test_row_split_weights_work_as_tensor_parallel_shards(style):
    """Rows of linear_qkv / linear_fc1 split in two halves (columns of linear_proj / linear_fc2
    likewise) are whole heads and channels: the sum of the two partial outputs is the full one."""
    config = STYLES[style](add_bias_linear=False)
    layer = GPTModel(config).layers["0"]
    x = torch.randn(2, 6, config.hidden_size)
    position_ids = torch.arange(6)[None]
    full_attention = layer.self_attention(x, position_ids)
    full_mlp = layer.mlp(x)

    def shard(linear, dim, rank):
        part = torch.nn.Linear(1, 1, bias=False)
        part.weight = torch.nn.Parameter(linear.weight.chunk(2, dim=dim)[rank].clone())
        return part

    partial_attention, partial_mlp = 0, 0
    for rank in range(2):
        attention = SelfAttention(config, layer_number=0)
        attention.linear_qkv = shard(layer.self_attention.linear_qkv, 0, rank)
        attention.linear_proj = shard(layer.self_attention.linear_proj, 1, rank)
        partial_attention = partial_attention + attention(x, position_ids)
        mlp = MLP(config)
        mlp.linear_fc1 = shard(layer.mlp.linear_fc1, 0, rank)
        mlp.linear_fc2 = shard(layer.mlp.linear_fc2, 1, rank)
        partial_mlp = partial_mlp + mlp(x)
    torch.testing.assert_close(partial_attention, full_attention)
    torch.testing.assert_close(partial_mlp, full_mlp)


# ---- masks and positions ------------------------------------------------------------------------

@pytest.mark.parametrize("style", STYLES)
def test_explicit_causal_mask_equals_is_causal(style):
    config = STYLES[style]()
    model = GPTModel(config)
    tokens = torch.randint(0, config.vocab_size, (2, 10))
    mask = torch.ones(10, 10, dtype=torch.bool).tril().expand(2, 1, 10, 10)
    torch.testing.assert_close(model(tokens, attention_mask=mask), model(tokens))


def test_mask_hides_keys():
    """Changing a token a query may not see leaves that query's output unchanged."""
    model = GPTModel(llama_config())
    tokens = torch.randint(0, 96, (1, 8))
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    mask[:, 2] = False
    mask[2, 2] = True  # row 2 must keep at least one key
    mask = mask.expand(1, 1, 8, 8)
    changed = tokens.clone()
    changed[0, 2] = (tokens[0, 2] + 1) % 96
    out_a, out_b = model(tokens, attention_mask=mask), model(changed, attention_mask=mask)
    torch.testing.assert_close(out_a[:, 3:], out_b[:, 3:])
    assert not torch.allclose(out_a[:, 2], out_b[:, 2])


def test_rope_matches_direct_formula():
    d, base = 8, 10000.0
    x = torch.randn(1, 3, 5, d)  # [b, heads, s, d]
    positions = torch.tensor([[0, 1, 4, 9, 30]])
    cos, sin = rotary_cos_sin(positions, d, base)
    rotated = apply_rotary(x, cos, sin)
    expected = torch.empty_like(x)
    for t, p in enumerate(positions[0].tolist()):
        for i in range(d // 2):
            theta = p * base ** (-2 * i / d)
            a, b = x[..., t, i], x[..., t, i + d // 2]
            expected[..., t, i] = a * math.cos(theta) - b * math.sin(theta)
            expected[..., t, i + d // 2] = a * math.sin(theta) + b * math.cos(theta)
    torch.testing.assert_close(rotated, expected)


def test_rope_scores_depend_only_on_relative_position():
    d = 16
    q, k = torch.randn(1, 1, 1, d), torch.randn(1, 1, 1, d)

    def score(pq, pk):
        cq, sq = rotary_cos_sin(torch.tensor([[pq]]), d, 10000.0)
        ck, sk = rotary_cos_sin(torch.tensor([[pk]]), d, 10000.0)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum()

    torch.testing.assert_close(score(7, 3), score(24, 20))
    assert not torch.allclose(score(7, 3), score(7, 4))


def test_learned_positions_limit():
    model = GPTModel(gpt2_config(max_position_embeddings=8))
    with pytest.raises(ValueError, match="--max-position-embeddings"):
        model(torch.zeros(1, 9, dtype=torch.long))


# ---- config errors ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "fields, flags",
    [
        (dict(hidden_size=30, num_attention_heads=4), ["--hidden-size", "--num-attention-heads"]),
        (dict(num_attention_heads=6, num_query_groups=4, hidden_size=48), ["--num-attention-heads", "--num-query-groups"]),
        (dict(num_query_groups=0), ["--num-query-groups"]),
        (dict(position_embedding_type="alibi"), ["--position-embedding-type"]),
        (dict(normalization="BatchNorm"), ["--normalization"]),
        (dict(position_embedding_type="rope", kv_channels=7), ["--kv-channels"]),
        (dict(hidden_dropout=1.5), ["--hidden-dropout"]),
        (dict(num_layers=0), ["--num-layers"]),
    ],
)
def test_bad_configs_name_the_flags(fields, flags):
    with pytest.raises(ValueError) as error:
        GPTConfig(**fields)
    for flag in flags:
        assert flag in str(error.value)


def test_split_into_pipeline_stages():
    """With embedding / final_layernorm set to None, two stages chain to the full model's logits."""
    import copy

    config = llama_config(num_layers=4)
    model = GPTModel(config)
    tokens = torch.randint(0, config.vocab_size, (2, 9))
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    for name in ("2", "3"):
        del first.layers[name]
    for name in ("0", "1"):
        del last.layers[name]
    first.final_layernorm, first.output_layer = None, None
    last.embedding = None
    hidden = first(tokens)
    assert hidden.shape == (2, 9, config.hidden_size)
    torch.testing.assert_close(last(hidden), model(tokens))
    assert {k.split(".")[1] for k in last.state_dict() if k.startswith("layers.")} == {"2", "3"}


# ---- --apply-layernorm-1p and --rotary-percent ---------------------------------------------------

@pytest.mark.parametrize("style", STYLES)
def test_layernorm_1p_is_the_same_function_with_weights_centred_on_zero(style):
    plain, one_p = STYLES[style](), STYLES[style](apply_layernorm_1p=True)
    a, b = GPTModel(plain), GPTModel(one_p)
    a.init_weights(3)
    b.init_weights(3)
    norms = [n for n, _ in b.named_parameters() if n.endswith("layernorm.weight")]
    assert norms and all(bool((dict(b.named_parameters())[n] == 0).all()) for n in norms)  # 1p init: zeros
    with torch.no_grad():
        for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            p.add_(torch.randn_like(p) * 0.1)
            q.copy_(p - 1 if n.endswith("layernorm.weight") else p)
    tokens = torch.randint(0, 96, (2, 12))
    torch.testing.assert_close(a(tokens), b(tokens), rtol=1e-5, atol=1e-5)


def test_partial_rotary_rotates_only_the_first_dims():
    x = torch.randn(2, 3, 5, 16)
    cos, sin = rotary_cos_sin(torch.arange(5).unsqueeze(0), 8, 10000.0)  # 8 of 16 dims
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 8:], x[..., 8:])
    torch.testing.assert_close(out[..., :8], apply_rotary(x[..., :8].contiguous(), cos, sin))
    config = llama_config(rotary_percent=0.5)
    assert config.rotary_dim == config.kv_channels // 2
    model = GPTModel(config)
    model.init_weights(0)
    assert model(torch.randint(0, 96, (1, 7))).shape == (1, 7, 96)


@pytest.mark.parametrize("fp32_residual, expected", [(False, torch.bfloat16), (True, torch.float32)])
def test_residual_stream_dtype_under_autocast(fp32_residual, expected):
    model = GPTModel(gpt2_config(fp32_residual_connection=fp32_residual))
    model.init_weights(0)
    seen = []
    for layer in model.layers.values():
        layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    tokens = torch.randint(0, 96, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, labels=tokens)
    assert seen == [expected] * len(model.layers) and loss.dtype == torch.float32
    loss.mean().backward()  # gradients reach the fp32 parameters
    assert model.embedding.word_embeddings.weight.grad.dtype == torch.float32
    seen.clear()
    model(tokens)  # without autocast everything stays float32
    assert seen == [torch.float32] * len(model.layers)


def test_rotary_tables_are_computed_once_per_forward_and_change_nothing(monkeypatch):
    import megatrain.models.common.rope as rope

    config = llama_config()
    model = GPTModel(config)
    model.init_weights(0)
    tokens = torch.randint(0, 96, (2, 9))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8, 9, 10, 11]])
    # each layer computing its own tables from the position ids (the fallback path) ...
    hidden = model.embed(tokens, positions)
    for layer in model.layers.values():
        hidden = layer(hidden, positions)
    per_layer = model.output_logits(hidden)
    calls = []
    real = rope.rotary_cos_sin
    monkeypatch.setattr(rope, "rotary_cos_sin", lambda *a: calls.append(a) or real(*a))
    shared = model(tokens, position_ids=positions)  # ... equals one table for all layers
    assert len(calls) == 1 and config.num_layers > 1
    assert torch.equal(shared, per_layer)
    assert rope.rotary_tables(gpt2_config(), positions) is None  # learned absolute positions: no tables


@pytest.mark.parametrize("fields, message", [(dict(rotary_percent=0.0), "--rotary-percent must be in"),
                                             (dict(rotary_percent=0.4), "even number of rotated dims")])
def test_bad_rotary_percent(fields, message):
    with pytest.raises(ValueError, match=message):
        llama_config(**fields)


@pytest.mark.parametrize("window", [(2, 0), (5, -1)])
def test_sliding_window_by_query_positions_matches_the_whole_sequence(window):
    """The context-parallel path: a rank's queries (the load-balanced chunks, out of order against
    the keys) with their global ``query_positions`` and the causal mask by global position give the
    whole sequence's rows of windowed attention."""
    from megatrain.models.common.attention import CoreAttention
    from megatrain.parallel.context_parallel import chunk_positions

    core = CoreAttention(llama_config(window_size=window))
    q, k, v = torch.randn(2, 6, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    whole = core(q, k, v, None, 0)
    for rank in range(2):
        mine = chunk_positions(16, 2, rank)
        causal = (torch.arange(16)[None, :] <= mine[:, None])[None, None]
        part = core(q[:, :, mine], k, v, causal, 0, query_positions=mine)
        torch.testing.assert_close(part, whole[:, :, mine])
