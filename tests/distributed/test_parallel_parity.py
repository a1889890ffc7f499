"""Every parallel layout trains exactly like one process: per-step losses and final parameters.

Each layout runs 5 optimizer steps (4 micro-batches per global batch, masked per-micro-batch mean
loss, active gradient clipping, AdamW) on gloo CPU processes and is compared with one plain
process doing all micro-batches; the gathered full parameters must agree within 1e-5 relative
error. All layouts of one world size share one spawned job (process start-up dominates).
"""

from __future__ import annotations

import pytest

from dist_harness import compare_to_reference, run_workers, tiny_config

TOLERANCE = 1e-5

# name -> (model style, layout keyword arguments of train_parallel)
WORLD2 = {
    "tp2": ("gpt2", dict(tp=2)),
    "tp2_sp": ("gpt2", dict(tp=2, sp=True)),
    "tp2_llama_gqa_swiglu_untied": ("llama", dict(tp=2)),
    "tp2_llama_fused_adamw": ("llama", dict(tp=2, fused=True)),
    "tp2_sp_llama_gqa_swiglu_untied": ("llama", dict(tp=2, sp=True)),
    "dp2_ddp": ("gpt2", dict(overlap=True, bucket_size=10_000)),
    "dp2_ddp_grad_fusion_chunked_loss": ("gpt2", dict(overlap=True, bucket_size=10_000, grad_fusion=True, chunk=16)),
    "dp2_ddp_grad_fusion_llama_selective": ("llama", dict(grad_fusion=True, recompute=("selective", None, None))),
    "dp2_zero1": ("llama", dict(zero=1)),
    "dp2_zero2": ("gpt2", dict(zero=2, overlap=True)),
    "dp2_zero3": ("llama", dict(zero=3, overlap=True)),
    "tp2_sp_recompute_full_uniform": ("llama", dict(tp=2, sp=True, recompute=("full", "uniform", 1))),
    "tp2_recompute_full_block": ("gpt2", dict(tp=2, recompute=("full", "block", 1))),
    "tp2_recompute_selective": ("llama", dict(tp=2, recompute=("selective", None, None))),
    "dp2_zero3_recompute_full": ("gpt2", dict(zero=3, recompute=("full", "uniform", 1))),
    # fp8: one step (two micro-batches per rank, the update, the gathered result). Over more steps
    # the last-bit differences of another reduction order flip some fp8 roundings, and AdamW's
    # normalised updates carry those differences on, as they would between any two fp8 runs.
    "dp2_ddp_fp8_hybrid": ("gpt2", dict(fp8="hybrid", steps=1)),
    "dp2_zero2_fp8_e4m3": ("llama", dict(zero=2, fp8="e4m3", steps=1)),
    "tp2_fp8_hybrid": ("gpt2", dict(tp=2, fp8="hybrid", steps=1)),
    "tp2_sp_fp8_e4m3": ("gpt2", dict(tp=2, sp=True, fp8="e4m3", steps=1)),
}
# One process with --use-distributed-optimizer / --zero-stage: FSDP2 over a mesh of one rank.
WORLD1 = {
    "one_process_zero1": ("llama", dict(zero=1)),
    "one_process_zero3": ("gpt2", dict(zero=3)),
    "one_process_grad_fusion": ("llama", dict(grad_fusion=True)),
}
WORLD4 = {
    "tp2_dp2": ("gpt2", dict(tp=2)),
    "tp2_dp2_fused_adamw": ("llama", dict(tp=2, fused=True)),
    "tp2_sp_dp2_zero3_selective": ("llama", dict(tp=2, sp=True, zero=3, recompute=("selective", None, None))),
}


def _run_all(rank: int, world_size: int, layouts: dict) -> dict:
    return {name: compare_to_reference(tiny_config(style), **layout) for name, (style, layout) in layouts.items()}


@pytest.fixture(scope="module")
def world2_results():
    return run_workers(_run_all, 2, WORLD2)


@pytest.fixture(scope="module")
def world1_results():
    return run_workers(_run_all, 1, WORLD1)


@pytest.fixture(scope="module")
def world4_results():
    return run_workers(_run_all, 4, WORLD4)


def _check(results: list[dict], name: str, layout: dict) -> None:
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        assert r["loss"] < TOLERANCE, f"rank {rank}: per-step loss differs from one process by {r['loss']:.2e}"
        assert r["params"] < TOLERANCE, f"rank {rank}: final parameters differ from one process by {r['params']:.2e}"
        assert max(r["grad_norms"]) > 0.5, "gradient clipping was not active; the check would be weaker"
        if "unsynced" in r:
            assert r["unsynced"], "gradients were reduced on a micro-batch that should not synchronise"
        assert r["homogeneous_groups"], "an optimizer group mixes plain tensors and DTensors"
        assert r["fp8_layers"] == (8 if layout.get("fp8") else 0), "fp8 linear layers"
        assert r["fused_linears"] == (8 if layout.get("grad_fusion") else 0), "gradient-accumulation fusion layers"
        if "kept_unsharded" in r:
            assert r["kept_unsharded"], "ZeRO-1/2 resharded the parameters between micro-batches"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_world2_layout_matches_one_process(world2_results, name):
    _check(world2_results, name, WORLD2[name][1])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD1))
def test_one_process_sharded_optimizer_matches_plain_process(world1_results, name):
    _check(world1_results, name, WORLD1[name][1])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4))
def test_world4_layout_matches_one_process(world4_results, name):
    _check(world4_results, name, WORLD4[name][1])
