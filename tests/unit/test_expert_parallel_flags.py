"""Expert-parallel flags: --expert-model-parallel-size, --expert-tensor-parallel-size,
--moe-token-dispatcher-type (Megatron's flex running as alltoall, --moe-flex-dispatcher-backend with it)
and --moe-layer-recompute reach the typed configs, and every size that cannot work is refused with a
message naming the flags (as Megatron-LM's checks)."""

from __future__ import annotations

import pytest

from megatrain.parallel.dims import ParallelDims
from megatrain.parallel.expert_parallel import expert_grad_scale
from megatrain.parallel.recompute import RecomputeConfig
from megatrain.training.arguments import parse_args, validate_args
from megatrain.training.run_config import RunConfig

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--num-experts", "4"]


def parse(*extra: str, world_size: int = 4):
    return validate_args(parse_args([*BASE, *extra], validate=False), world_size=world_size)


def test_flags_reach_the_parallel_dims():
    a = parse("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall", "--moe-layer-recompute")
    run = RunConfig.from_args(a)
    assert (run.dims.ep, run.dims.moe_dispatcher, run.dims.expert_data_parallel) == (2, "alltoall", 2)
    assert run.parallelize.recompute.moe_layer
    a = parse()
    assert a.expert_model_parallel_size == 1 and a.expert_tensor_parallel_size is None
    assert a.moe_token_dispatcher_type == "allgather"  # Megatron's default


def test_flex_dispatcher_runs_as_alltoall_with_a_note():
    """Megatron's flex dispatcher (DeepEP / HybridEP kernels) moves the same tokens as its all-to-all one:
    megatrain runs it as alltoall (the same typed layout), saying so once; its backend is noted too."""
    flex = parse("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex",
                 "--moe-flex-dispatcher-backend", "hybridep")
    alltoall = parse("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall")
    assert flex.moe_token_dispatcher_type == "flex" and flex.moe_flex_dispatcher_backend == "hybridep"
    assert RunConfig.from_args(flex).dims == RunConfig.from_args(alltoall).dims
    assert RunConfig.from_args(flex).dims.moe_dispatcher == "alltoall"
    assert [n.split(" ", 2)[1] for n in flex.legacy_notes] == ["--moe-flex-dispatcher-backend",
                                                               "--moe-token-dispatcher-type"]
    assert "note: --moe-token-dispatcher-type flex runs as alltoall: Megatron's flex dispatcher moves the same " \
           "tokens with DeepEP / HybridEP kernels" in flex.legacy_notes[1]
    assert alltoall.legacy_notes == [] and alltoall.moe_flex_dispatcher_backend == "deepep"  # Megatron's default
    assert parse("--moe-token-dispatcher-type", "flex").legacy_notes[0].startswith(
        "note: --moe-token-dispatcher-type flex runs as alltoall")
    with pytest.raises(SystemExit):
        parse("--moe-flex-dispatcher-backend", "nvshmem")  # Megatron's choices only


def test_expert_tensor_parallel_default_is_noted_under_tensor_parallelism():
    a = parse("--tensor-model-parallel-size", "2", "--sequence-parallel")
    assert any("--expert-tensor-parallel-size defaults to 1" in n for n in a.legacy_notes)
    assert parse("--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1").legacy_notes == []
    # Megatron's default written out (ETP = TP) runs as 1, with a note
    a = parse("--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "2")
    assert a.expert_tensor_parallel_size == 1
    assert any("--expert-tensor-parallel-size 2 (the tensor-parallel size) runs as 1" in n for n in a.legacy_notes)


@pytest.mark.parametrize("extra, world, message", [
    (["--expert-model-parallel-size", "3"], 4, r"--expert-model-parallel-size \(3\) must divide .*world size \(4\)"),
    (["--expert-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"], 4,
     r"--expert-model-parallel-size \(4\) must divide .*--pipeline-model-parallel-size \(2\) = 2"),
    (["--expert-model-parallel-size", "8", "--num-experts", "12"], 8,
     r"--num-experts \(12\) must be divisible by --expert-model-parallel-size \(8\)"),
    (["--expert-tensor-parallel-size", "2", "--tensor-model-parallel-size", "4", "--sequence-parallel"], 4,
     "--expert-tensor-parallel-size 2: splitting experts"),
    (["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"], 4,
     "--expert-model-parallel-size 2 with --tensor-model-parallel-size 2 needs --sequence-parallel"),
    (["--moe-flex-dispatcher-backend", "ncclep"], 4,
     "--moe-flex-dispatcher-backend ncclep needs --moe-token-dispatcher-type flex"),
    (["--moe-layer-recompute", "--recompute-granularity", "full"], 4, "--moe-layer-recompute with"),
])
def test_sizes_that_cannot_work_are_refused(extra, world, message):
    with pytest.raises(SystemExit, match=message):
        parse(*extra, world_size=world)


def test_expert_parallel_needs_experts():
    with pytest.raises(SystemExit, match="--expert-model-parallel-size 2 needs a mixture-of-experts model"):
        validate_args(parse_args([*BASE[:-2], "--expert-model-parallel-size", "2"], validate=False), world_size=2)


@pytest.mark.parametrize("kwargs, scale", [
    (dict(world_size=2, ep=2), 0.5),  # dp 2, edp 1: the local gradient holds both ranks' tokens, halved
    (dict(world_size=4, ep=2), 0.5),  # dp 4, edp 2: FSDP's average over 2 of sums over 2, / 4
    (dict(world_size=2, tp=2, sequence_parallel=True, ep=2), 1.0),
    (dict(world_size=2, tp=2, sequence_parallel=True), 2.0),  # EP=1: the two sequence halves summed
    (dict(world_size=2, tp=2), 1.0),  # no SP: tensor-parallel ranks hold the same tokens
    (dict(world_size=8, cp=2, ep=4), 0.25),  # 1 / ep without tensor parallelism
])
def test_expert_gradient_scale(kwargs, scale):
    assert expert_grad_scale(ParallelDims(**kwargs)) == scale


def test_recompute_config_moe_layer():
    assert RecomputeConfig("selective", moe_layer=True).moe_layer
    with pytest.raises(ValueError, match="--moe-layer-recompute"):
        RecomputeConfig("full", moe_layer=True)
