"""fp8 matmuls through torchao: which layers convert, names and initial weights unchanged, the flags' checks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao.float8")

from megatrain.models.gpt.config import GPTConfig  # noqa: E402
from megatrain.runtime.fp8 import Fp8Config, convert_to_fp8  # noqa: E402
from megatrain.models.gpt import GPTModel  # noqa: E402
from megatrain.parallel.dims import ParallelDims  # noqa: E402
from megatrain.parallel.parallelize import ParallelizeConfig, parallelize_model  # noqa: E402
from megatrain.training.arguments import parse_args  # noqa: E402
from megatrain.training.run_config import RunConfig  # noqa: E402

LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128,
             max_position_embeddings=32, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             ffn_hidden_size=96, add_bias_linear=False, untie_embeddings_and_output_weights=True)


def _model(**fields) -> GPTModel:
    with torch.device("meta"):
        return GPTModel(GPTConfig(**fields))


@pytest.mark.parametrize("fmt, grad_dtype", [("hybrid", torch.float8_e5m2), ("e4m3", torch.float8_e4m3fn)])
def test_transformer_linears_convert_and_the_output_layer_stays(fmt, grad_dtype):
    model = _model(**LLAMA)
    names = [n for n, _ in model.named_parameters()]
    converted, kept = convert_to_fp8(model, Fp8Config(fmt))
    assert converted == [f"layers.{i}.{m}" for i in range(2) for m in
                         ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    assert kept == []
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints and conversion see the same names
    assert type(model.output_layer) is torch.nn.Linear
    qkv = model.layers["0"].self_attention.linear_qkv
    assert type(qkv).__name__ == "Float8Linear"
    assert qkv.config.cast_config_input.target_dtype == torch.float8_e4m3fn
    assert qkv.config.cast_config_grad_output.target_dtype == grad_dtype


def test_sizes_the_fp8_kernels_refuse_stay_in_higher_precision():
    model = _model(num_layers=1, hidden_size=40, num_attention_heads=4, vocab_size=64, ffn_hidden_size=64)
    converted, kept = convert_to_fp8(model, Fp8Config("hybrid"))
    assert converted == [] and kept == ["layers.0.self_attention.linear_qkv", "layers.0.self_attention.linear_proj",
                                        "layers.0.mlp.linear_fc1", "layers.0.mlp.linear_fc2"]


def test_under_tensor_parallelism_the_local_shards_must_fit_the_kernels():
    # hidden 64, ffn 96: with TP=2 fc1's output shard is 48 and fc2's input shard 48 (multiples of
    # 16); with TP=4 they are 24: those two layers stay in higher precision, the attention ones convert.
    sizes = dict(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=64, ffn_hidden_size=96)
    converted, kept = convert_to_fp8(_model(**sizes), Fp8Config("hybrid"), tp=2)
    assert len(converted) == 4 and kept == []
    converted, kept = convert_to_fp8(_model(**sizes), Fp8Config("hybrid"), tp=4)
    assert kept == ["layers.0.mlp.linear_fc1", "layers.0.mlp.linear_fc2"]
    assert converted == ["layers.0.self_attention.linear_qkv", "layers.0.self_attention.linear_proj"]


def test_parallelize_converts_before_initialising_so_the_weights_are_the_same():
    plain = parallelize_model(_model(**LLAMA), ParallelDims(1), ParallelizeConfig(), device=torch.device("cpu"), seed=3)
    fp8 = parallelize_model(_model(**LLAMA), ParallelDims(1), ParallelizeConfig(fp8_format="hybrid"),
                            device=torch.device("cpu"), seed=3)
    assert len(fp8.fp8_report[0]) == 8
    plain, fp8 = plain.model, fp8.model
    for (n, p), (m, q) in zip(plain.named_parameters(), fp8.named_parameters()):
        assert n == m and torch.equal(p, q), n
    x = torch.randint(0, 128, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = plain(x, labels=x).mean(), fp8(x, labels=x).mean()
    assert abs(a.item() - b.item()) < 0.05 * abs(a.item())  # fp8 rounding, same model


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--device", "cpu"]


@pytest.mark.parametrize("extra, message", [
    (["--fp8-format", "hybrid"], "--fp8-format needs --bf16"),
    (["--fp8-format", "hybrid", "--bf16", "--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8 is not supported"),
    (["--fp8-margin", "1"], "has no effect without --fp8-format"),
])
def test_fp8_flag_mistakes_name_the_flag(extra, message):
    with pytest.raises(SystemExit, match=message):
        parse_args([*BASE, *extra], validate=True)


def test_megatron_fp8_example_flags_select_delayed_scaling():
    """Megatron's own fp8 example passes delayed-scaling settings (its default recipe) and --fp8-param-gather."""
    args = parse_args([*BASE, "--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
                       "--fp8-amax-compute-algo", "max", "--fp8-param-gather"], validate=True)
    assert (args.fp8_recipe, args.fp8_amax_history_len, args.fp8_amax_compute_algo) == ("delayed", 1024, "max")
    notes = "\n".join(args.legacy_notes)
    assert "--fp8-param-gather" in notes and "gathered in bf16" in notes
    tensorwise = parse_args([*BASE, "--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
                             "--fp8-margin", "1"], validate=True)
    assert any("--fp8-margin 1: delayed scaling's settings, unused with --fp8-recipe tensorwise" in n
               for n in tensorwise.legacy_notes)


def test_fp8_flags_parse():
    args = parse_args([*BASE, "--bf16", "--fp8-format", "e4m3"], validate=True)
    assert args.fp8_format == "e4m3" and args.fp8_recipe == "tensorwise"
    assert RunConfig.from_args(args).parallelize.fp8_format == "e4m3"
