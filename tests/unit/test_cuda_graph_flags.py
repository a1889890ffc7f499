"""--cuda-graph-impl local / --enable-cuda-graph: which runs may record their micro-batch as a CUDA
graph, and the clear refusals (the recording and replay themselves are checked on a GPU:
tests/e2e/test_fast_path_parity.py)."""

from __future__ import annotations

import pytest

from megatrain.training.arguments import parse_args, validate_args

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--mock-data"]


def _args(*extra: str):
    return parse_args([*BASE, *extra], validate=True)


def test_local_graphs_and_the_older_flag_on_cuda():
    a = _args("--device", "cuda", "--bf16", "--cuda-graph-impl", "local")
    assert a.cuda_graph_impl == "local" and a.cuda_graph_warmup_steps == 3
    b = _args("--device", "cuda", "--enable-cuda-graph", "--cuda-graph-scope", "full_iteration",
              "--cuda-graph-warmup-steps", "1")
    assert b.cuda_graph_impl == "local" and b.cuda_graph_warmup_steps == 1
    assert _args("--device", "cuda").cuda_graph_impl == "none"


@pytest.mark.parametrize("extra,message", [
    (["--device", "cpu", "--cuda-graph-impl", "local"], "needs a CUDA device"),
    (["--device", "cuda", "--cuda-graph-impl", "transformer_engine"], "Transformer Engine"),
    (["--device", "cuda", "--cuda-graph-impl", "local", "--cuda-graph-scope", "attn", "mlp"],
     "--cuda-graph-scope attn mlp"),
    (["--device", "cuda", "--cuda-graph-scope", "full_iteration"], "needs --cuda-graph-impl local"),
    (["--device", "cuda", "--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "0"], "at least 1"),
    (["--device", "cuda", "--enable-cuda-graph", "--fp16"], "not supported with --fp16"),
    (["--device", "cuda", "--enable-cuda-graph", "--recompute-granularity", "selective"],
     "not supported with --recompute-granularity selective"),
])
def test_refused_combinations_name_the_flags(extra, message):
    with pytest.raises(SystemExit, match=message):
        _args(*extra)


def test_refused_with_several_processes():
    args = parse_args([*BASE, "--device", "cuda", "--cuda-graph-impl", "local"], validate=False)
    with pytest.raises(SystemExit, match="2 processes"):
        validate_args(args, world_size=2)
