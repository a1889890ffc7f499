"""Speed switches: compile and chunked-loss defaults per device, the flag wiring into the model, and
the attention-kernel warning logic (the CUDA probe itself is checked on a GPU)."""

from __future__ import annotations

import pytest
import torch

from megatrain.runtime.attention_backends import (AttentionCase, attention_warning, probe_backends, static_hints,
                                                 warn_if_attention_falls_back)
from megatrain.models.gpt.config import GPTConfig
from megatrain.runtime.fp8 import fp8_available
from megatrain.runtime.fused_loss import ChunkedCrossEntropy
from megatrain.models.gpt import GPTModel
from megatrain.parallel.dims import ParallelDims
from megatrain.parallel.parallelize import ParallelizeConfig, parallelize_model
from megatrain.training.arguments import parse_args
from megatrain.training.run_config import RunConfig

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--mock-data"]


def _args(*extra: str):
    return parse_args([*BASE, *extra], validate=True)


def test_cpu_defaults_are_plain_and_cuda_defaults_are_fast():
    cpu = _args("--device", "cpu")
    assert cpu.use_torch_compile is False and cpu.cross_entropy_chunk_size == 0
    cuda = _args("--device", "cuda")  # validation only decides defaults; nothing touches the GPU here
    assert cuda.use_torch_compile is True and cuda.cross_entropy_chunk_size == 1024


def test_explicit_flags_win_over_device_defaults():
    a = _args("--device", "cuda", "--no-torch-compile", "--cross-entropy-chunk-size", "0")
    assert a.use_torch_compile is False and a.cross_entropy_chunk_size == 0
    b = _args("--device", "cpu", "--use-torch-compile", "--cross-entropy-chunk-size", "256")
    assert b.use_torch_compile is True and b.cross_entropy_chunk_size == 256
    with pytest.raises(SystemExit, match="--cross-entropy-chunk-size"):
        _args("--cross-entropy-chunk-size", "-1")


def test_parallelize_sets_the_chunked_loss_from_the_flag():
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, hidden_dropout=0.0,
                       attention_dropout=0.0)
    for chunk, expected in ((0, None), (48, 48)):
        args = _args("--device", "cpu", "--cross-entropy-chunk-size", str(chunk))
        cfg = RunConfig.from_args(args).parallelize
        assert cfg.cross_entropy_chunk_size == chunk
        with torch.device("meta"):
            model = GPTModel(config)
        head = parallelize_model(model, ParallelDims(1), cfg, device=torch.device("cpu"), seed=1).loss_head
        got = head.chunk_size if isinstance(head, ChunkedCrossEntropy) else None
        assert got == expected
        if expected:
            assert head.compile is False  # per-chunk kernels are compiled only on CUDA


def test_compile_scope_and_mode_reach_the_model(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: calls.append((type(self).__name__, kw)))
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, hidden_dropout=0.0,
                       attention_dropout=0.0)
    for extra, expected in (([], [("GPTModel", {"mode": None})]),  # auto: the whole model on one process
                            (["--torch-compile-scope", "layer"], [("TransformerLayer", {"mode": None})] * 2),
                            (["--torch-compile-scope", "layer", "--torch-compile-mode", "max-autotune-no-cudagraphs"],
                             [("TransformerLayer", {"mode": "max-autotune-no-cudagraphs"})] * 2),
                            (["--torch-compile-scope", "model"], [("GPTModel", {"mode": None})])):
        calls.clear()
        args = _args("--device", "cpu", "--use-torch-compile", *extra)
        with torch.device("meta"):
            model = GPTModel(config)
        parallelize_model(model, ParallelDims(1), RunConfig.from_args(args).parallelize, device=torch.device("cpu"),
                          seed=1)
        assert calls == expected, extra


def test_auto_compile_scope_follows_the_layout():
    assert _args("--device", "cpu", "--use-torch-compile").torch_compile_scope == "model"
    assert _args("--device", "cpu", "--use-torch-compile", "--use-distributed-optimizer").torch_compile_scope == "layer"
    if fp8_available():
        assert _args("--device", "cpu", "--use-torch-compile", "--bf16", "--fp8-format", "hybrid"
                     ).torch_compile_scope == "layer"


def test_cuda_graph_modes_are_refused_in_training():
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(SystemExit, match=f"--torch-compile-mode {mode} records CUDA graphs"):
            _args("--device", "cpu", "--use-torch-compile", "--torch-compile-mode", mode)
    # without compilation the mode is not used
    assert _args("--device", "cpu", "--no-torch-compile", "--torch-compile-mode", "reduce-overhead")


def test_whole_model_compile_is_refused_with_sharded_layouts():
    with pytest.raises(SystemExit, match="--torch-compile-scope layer"):
        _args("--device", "cpu", "--torch-compile-scope", "model", "--use-distributed-optimizer")
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64)
    with torch.device("meta"):
        model = GPTModel(config)
    cfg = ParallelizeConfig(compile_layers=True, compile_scope="model")
    cfg.data_parallel.zero_stage = 1
    with pytest.raises(ValueError, match="--torch-compile-scope layer"):
        parallelize_model(model, ParallelDims(1), cfg, device=torch.device("cpu"), seed=1)


def test_hints_name_the_flags_that_cause_a_fallback():
    assert static_hints(AttentionCase(128, 1, torch.bfloat16)) == []
    hints = " ".join(static_hints(AttentionCase(320, 4, torch.float32, explicit_mask=True)))
    assert "--bf16" in hints and "--kv-channels" in hints and "--reset-attention-mask" in hints
    assert "multiple of 8" in " ".join(static_hints(AttentionCase(36, 1, torch.bfloat16)))


def test_warning_only_when_every_fused_backend_refuses():
    refused = {"FLASH_ATTENTION": "head dim too large", "EFFICIENT_ATTENTION": "dtype",
               "CUDNN_ATTENTION": "not in this torch version"}
    text = attention_warning(refused, ["head dim 320 > 256"])
    assert text is not None and "math fallback" in text and "head dim too large" in text and "320" in text
    for ok in refused:
        assert attention_warning({**refused, ok: None}, []) is None


def test_probe_runs_and_reports_every_backend_on_cpu():
    # CPU has a flash-attention kernel of its own; the probe must report on all three and run cleanly.
    results = probe_backends(AttentionCase(16, 2, torch.float32), torch.device("cpu"), seq_length=8)
    assert set(results) == {"FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"}
    assert results["FLASH_ATTENTION"] is None
    assert all(r is None or isinstance(r, str) and r for r in results.values())
    # Off CUDA the start-up check does nothing.
    assert warn_if_attention_falls_back(GPTConfig(), torch.float32, torch.device("cpu")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_probe_finds_a_fused_kernel_for_the_target_shapes_and_flags_fp32_head_dim_512():
    device = torch.device("cuda")
    for heads_per_group in (1, 4):  # GPT-2 / 1.7B style, LLaMA GQA style
        case = AttentionCase(128, heads_per_group, torch.bfloat16)
        assert attention_warning(probe_backends(case, device), static_hints(case)) is None
    bad = AttentionCase(512, 1, torch.float32, explicit_mask=True)
    results = probe_backends(bad, device)
    assert results["FLASH_ATTENTION"] is not None  # flash never takes fp32 with a mask


def test_tp_comm_overlap_is_megatrons_flag_with_clear_conditions(monkeypatch):
    tp2 = ["--tensor-model-parallel-size", "2"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="--tp-comm-overlap .* needs --sequence-parallel"):
        _args("--device", "cuda", *tp2, "--tp-comm-overlap")
    on = _args("--device", "cuda", *tp2, "--sequence-parallel", "--tp-comm-overlap")
    assert on.tp_comm_overlap and RunConfig.from_args(on).parallelize.tp_comm_overlap
    for extra in (["--device", "cpu", *tp2, "--sequence-parallel"],  # no CUDA: runs without overlap, says so
                  ["--device", "cuda", *tp2, "--sequence-parallel", "--no-torch-compile"],
                  ["--device", "cpu", "--tensor-model-parallel-size", "1"]):  # no TP: nothing to overlap
        args = _args(*extra, "--tp-comm-overlap")
        assert not args.tp_comm_overlap
        assert any("--tp-comm-overlap" in note for note in args.legacy_notes)
