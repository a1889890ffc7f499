"""initial_value is computed on the CPU whatever the default device, so a model built under
`with torch.device("cuda")` (or meta) gets the same weights as one built on the CPU; a model whose
parameters are on a GPU gets them drawn there (the GPU's generator) unless --use-cpu-initialization."""

from __future__ import annotations

import pytest
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


def test_use_cpu_initialization_is_megatron_s_flag_and_reaches_the_parallelize_config():
    from megatrain.training.arguments import parse_args
    from megatrain.training.run_config import RunConfig

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
    assert RunConfig.from_args(parse_args(base)).parallelize.cpu_initialization is False
    assert RunConfig.from_args(parse_args([*base, "--use-cpu-initialization"])).parallelize.cpu_initialization


def _small_gpt(device: str):
    from megatrain.models.gpt.model import GPTModel

    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=96,
                    max_position_embeddings=16)
    with torch.device("meta"):
        model = GPTModel(cfg)
    model.to_empty(device=device)
    return model, cfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_model_on_a_gpu_draws_there_the_same_values_each_time_and_the_cpu_s_with_the_flag():
    from megatrain.parallel.parallelize import init_parameters

    on_cpu, cfg = _small_gpt("cpu")
    init_parameters(on_cpu, cfg, 5)
    drawn = []
    for _ in range(2):
        model, _ = _small_gpt("cuda")
        init_parameters(model, cfg, 5)
        drawn.append({k: v.detach().cpu() for k, v in model.named_parameters()})
    flagged, _ = _small_gpt("cuda")
    init_parameters(flagged, cfg, 5, on_cpu=True)
    for name, want in on_cpu.named_parameters():
        assert torch.equal(drawn[0][name], drawn[1][name]), name
        assert torch.equal(flagged.get_parameter(name).cpu(), want), name
        if name.endswith("linear_qkv.weight"):  # drawn: the GPU's generator gives other values, same spread
            assert not torch.equal(drawn[0][name], want.detach())
            assert abs(drawn[0][name].std().item() / want.std().item() - 1) < 0.1
        if "layernorm" in name or name.endswith("bias"):
            assert torch.equal(drawn[0][name], want.detach()), name
