"""RunConfig: the flags become the typed configs in one place, their checks stop a bad command line at
parse time as one line, and megatrain.parallel never reads the namespace."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megatrain.training.arguments import parse_args, validate_args
from megatrain.training.run_config import RunConfig

BASE = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--device", "cpu"]
PARALLEL = Path(__file__).resolve().parents[2] / "megatrain" / "parallel"


def _validated(*extra: str, world_size: int = 1):
    return validate_args(parse_args([*BASE, *extra], validate=False), world_size=world_size)


def test_every_typed_config_comes_from_its_flags():
    args = _validated("--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size",
                      "2", "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "8", "--bf16",
                      "--zero-stage", "3", "--recompute-granularity", "selective", "--min-lr", "1e-5",
                      "--adam-beta2", "0.95", "--lr-warmup-iters", "2", "--split", "90,5,5", world_size=8)
    run = RunConfig.from_args(args)
    assert (run.dims.world_size, run.dims.pp, run.dims.dp, run.dims.tp, run.dims.sequence_parallel) == (8, 2, 2, 2, True)
    assert (run.pipeline.size, run.pipeline.virtual_stages, run.pipeline.schedule) == (2, 2, "interleaved-1f1b")
    p = run.parallelize
    assert p.data_parallel.zero_stage == 3 and p.data_parallel.param_dtype == torch.bfloat16
    assert p.recompute.granularity == "selective" and p.compute_dtype == torch.bfloat16 == run.precision.dtype
    assert p.compile_layers is False and p.cross_entropy_chunk_size == 0  # the CPU defaults validate_args chose
    assert run.data.mock_data and run.data.split == "90,5,5" and run.data.seq_length == 16
    assert (run.optimizer.lr, run.optimizer.min_lr, run.optimizer.adam_beta2) == (1e-3, 1e-5, 0.95)
    # the schedule counts samples: 2 warmup and 10 decay iterations of 8 samples
    assert (run.lr_schedule.lr_warmup_steps, run.lr_schedule.lr_decay_steps) == (16, 80)


@pytest.mark.parametrize("extra, message", [
    (["--adam-beta1", "1.5"], "--adam-beta1 must be in [0, 1), got 1.5"),  # OptimizerConfig
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),  # the LR schedule
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size must be positive, got 0"),  # DataParallelConfig
    (["--recompute-granularity", "full", "--recompute-num-layers", "0"],
     "--recompute-num-layers must be at least 1, got 0"),  # RecomputeConfig
    (["--context-parallel-size", "0"], "--context-parallel-size must be at least 1, got 0"),  # ParallelDims
    (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups must be positive, got 0"),
    (["--num-attention-heads", "0"], "--num-attention-heads must be positive, got 0"),  # GPTConfig, before a division
    (["--hidden-dropout", "1.0"], "--hidden-dropout must be in [0, 1), got 1.0"),
])
def test_typed_config_checks_stop_the_command_line_with_one_line(extra, message):
    with pytest.raises(SystemExit) as e:
        _validated(*extra)
    text = str(e.value.code)
    assert text.startswith("error: ") and message in text and "\n" not in text, text


def test_parallel_never_reads_the_namespace():
    for path in sorted(PARALLEL.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert "from_args" not in names, path.name
        imports = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        if path.name != "flags.py":  # the module that adds parallelism's flags to a parser
            assert "argparse" not in imports, path.name
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr"
                 and n.args and getattr(n.args[0], "id", None) == "args"]
        assert not calls, f"{path.name}: getattr(args, ...)"
