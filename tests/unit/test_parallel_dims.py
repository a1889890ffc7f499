"""ParallelDims validation, launcher environment (torchrun / SLURM) and parallel flag mapping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatrain.models.gpt.config import GPTConfig
from megatrain.parallel.data_parallel import DataParallelConfig
from megatrain.parallel.dims import ParallelDims
from megatrain.parallel.distributed import env_from_environ, first_slurm_host, setup_env_from_slurm
from megatrain.parallel.recompute import RecomputeConfig


def test_data_parallel_is_the_rest_of_the_world():
    dims = ParallelDims(16, tp=2, pp=2)
    assert (dims.pp, dims.dp, dims.cp, dims.tp) == (2, 4, 1, 2)
    assert ParallelDims(3).dp == 3
    assert not ParallelDims(4, tp=1, sequence_parallel=True).sequence_parallel


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, tp=4), "not divisible by --tensor-model-parallel-size"),
    (dict(world_size=8, tp=2, pp=3), "--pipeline-model-parallel-size"),
    (dict(world_size=4, tp=0), "--tensor-model-parallel-size must be at least 1"),
    (dict(world_size=8, tp=2, dp=2), "does not equal the world size"),
])
def test_sizes_that_do_not_fit_the_world(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def _config(**kw) -> GPTConfig:
    fields = dict(num_layers=2, hidden_size=48, num_attention_heads=6, vocab_size=128, ffn_hidden_size=96)
    fields.update(kw)
    return GPTConfig(**fields)


@pytest.mark.parametrize("config, tp, message", [
    (_config(), 4, r"--num-attention-heads \(6\) must be divisible"),
    (_config(num_attention_heads=4, hidden_size=32, num_query_groups=1), 2, r"--num-query-groups \(1\)"),
    (_config(ffn_hidden_size=100), 4, r"--num-attention-heads|--ffn-hidden-size"),
    (_config(num_attention_heads=4, hidden_size=32, ffn_hidden_size=90), 4, r"--ffn-hidden-size \(90\)"),
    (_config(num_attention_heads=4, hidden_size=32, vocab_size=130), 4, "padded vocabulary"),
])
def test_model_shapes_that_do_not_split(config, tp, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(tp * 2, tp=tp).validate_model(config)


def test_vocab_padding_and_sequence_length_checks():
    dims = ParallelDims(2, tp=2, sequence_parallel=True)
    dims.validate_model(_config(num_attention_heads=4, hidden_size=32, vocab_size=256), orig_vocab_size=200,
                        make_vocab_size_divisible_by=128, seq_length=32)
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        dims.validate_model(_config(num_attention_heads=4, hidden_size=32, vocab_size=128), orig_vocab_size=100,
                            make_vocab_size_divisible_by=128)
    with pytest.raises(ValueError, match="--seq-length"):
        dims.validate_model(_config(num_attention_heads=4, hidden_size=32), seq_length=33)


def test_mesh_is_required_before_use():
    with pytest.raises(RuntimeError, match="build_mesh"):
        ParallelDims(1).mesh
    assert ParallelDims(1).dp_rank == 0


@pytest.mark.parametrize("nodelist, host", [
    ("gpu[003-010,012],cpu1", "gpu003"), ("node7", "node7"), ("a1,b2", "a1"), ("rack[1-2]-n[08-09]", "rack1-n08"),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_slurm_environment_fills_torchrun_variables():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "dgx[12-13]",
           "SLURM_JOB_ID": "4242"}
    assert setup_env_from_slurm(env)
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "8" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "dgx12" and env["MASTER_PORT"] == str(20000 + 4242)
    got = env_from_environ(env)
    assert (got.rank, got.world_size, got.local_rank) == (5, 8, 1)


def test_torchrun_variables_win_over_slurm():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert not setup_env_from_slurm(env)
    got = env_from_environ(env)
    assert (got.rank, got.world_size, got.source) == (1, 2, "torchrun")
    assert env_from_environ({}).source == "single"
    with pytest.raises(ValueError, match="RANK"):
        env_from_environ({"RANK": "3", "WORLD_SIZE": "2"})


def test_flag_mapping():
    from megatrain.training.arguments import parse_args
    from megatrain.training.run_config import RunConfig

    args = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                       "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--device", "cpu",
                       "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "1000", "--bf16",
                       "--recompute-granularity", "full"])
    run = RunConfig.from_args(args)
    cfg = run.parallelize.data_parallel
    assert cfg.zero_stage == 1 and cfg.overlap_grad_reduce and not cfg.overlap_param_gather
    assert cfg.bucket_size == 1000 and cfg.param_dtype == torch.bfloat16 and not cfg.grad_reduce_in_bf16
    assert (run.parallelize.recompute.granularity, run.parallelize.recompute.method) == ("full", "uniform")
    assert run.parallelize.compute_dtype == torch.bfloat16 and (run.dims.world_size, run.dims.dp) == (1, 1)
    with pytest.raises(ValueError, match="--zero-stage"):
        DataParallelConfig(zero_stage=4)
    rc = RecomputeConfig("full")
    assert (rc.method, rc.num_layers) == ("uniform", 1)
    with pytest.raises(ValueError, match="--recompute-method"):
        RecomputeConfig("full", "sometimes", 1)
    with pytest.raises(ValueError, match="--recompute-granularity"):
        RecomputeConfig("partial")


def test_slurm_master_address_is_filled_when_ranks_come_from_elsewhere():
    env = {"RANK": "3", "WORLD_SIZE": "4", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_NODELIST": "n[4-5]"}
    assert not setup_env_from_slurm(env)
    assert env["MASTER_ADDR"] == "n4" and env["MASTER_PORT"] == "20000"


@pytest.mark.parametrize("script", sorted(p.name for p in (Path(__file__).resolve().parents[2] / "examples").iterdir()
                                           if p.is_file() and "pretrain_gpt" in p.read_text()))
def test_example_launch_scripts_use_known_flags(script):
    """Every flag the example scripts pass to pretrain_gpt.py is one the parser knows."""
    import re
    from pathlib import Path

    from megatrain.training.arguments import parse_args

    text = (Path(__file__).resolve().parents[2] / "examples" / script).read_text()
    command = text.split("pretrain_gpt.py", 1)[1].split('"$@"', 1)[-1]
    command = re.sub(r"\\\n", " ", command)
    tokens = [t for t in command.split() if not t.startswith("'") and t != "_"]
    tokens = ["8" if t.startswith('"$') or t.startswith("$") else t for t in tokens]
    parse_args(tokens, validate=False)
