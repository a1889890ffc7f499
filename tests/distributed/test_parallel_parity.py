"""Every parallel layout trains exactly like one process: per-step losses and final parameters.

Each layout is the real trainer (``Trainer.train_step``) built from Megatron flags, 5 iterations
(4 micro-batches per global batch, masked per-micro-batch mean loss, active gradient clipping,
AdamW) on gloo CPU processes, compared with the same trainer in one plain process; the gathered
full parameters must agree within 1e-5 relative error. All layouts of one world size and their
references share one spawned job (process start-up dominates).
"""

from __future__ import annotations

import pytest

from dist_harness import CLIP, compare, run_layouts

TOLERANCE = 1e-5
DDP_OVERLAP = "--overlap-grad-reduce --overlap-param-gather"
SELECTIVE = "--recompute-granularity selective"

# name -> (model style, layout flags, keyword arguments of train_layout)
WORLD2 = {
    "tp2": ("gpt2", "--tensor-model-parallel-size 2", {}),
    "tp2_sp": ("gpt2", "--tensor-model-parallel-size 2 --sequence-parallel", {}),
    "tp2_llama_gqa_swiglu_untied": ("llama", "--tensor-model-parallel-size 2", {}),
    "tp2_llama_fused_adamw": ("llama", "--tensor-model-parallel-size 2", dict(fused_adamw=True)),
    "tp2_sp_llama_gqa_swiglu_untied": ("llama", "--tensor-model-parallel-size 2 --sequence-parallel", {}),
    "dp2_ddp": ("gpt2", f"{DDP_OVERLAP} --ddp-bucket-size 10000", {}),
    "dp2_ddp_grad_fusion_chunked_loss": ("gpt2", f"{DDP_OVERLAP} --ddp-bucket-size 10000 "
                                                 "--cross-entropy-chunk-size 16", dict(grad_fusion=True)),
    "dp2_ddp_grad_fusion_llama_selective": ("llama", SELECTIVE, dict(grad_fusion=True)),
    "dp2_zero1": ("llama", "--use-distributed-optimizer", {}),
    "dp2_zero2": ("gpt2", f"--zero-stage 2 {DDP_OVERLAP}", {}),
    "dp2_zero3": ("llama", f"--zero-stage 3 {DDP_OVERLAP}", {}),
    "tp2_sp_recompute_full_uniform": ("llama", "--tensor-model-parallel-size 2 --sequence-parallel "
                                               "--recompute-granularity full --recompute-method uniform "
                                               "--recompute-num-layers 1", {}),
    "tp2_recompute_full_block": ("gpt2", "--tensor-model-parallel-size 2 --recompute-granularity full "
                                         "--recompute-method block --recompute-num-layers 1", {}),
    "tp2_recompute_selective": ("llama", f"--tensor-model-parallel-size 2 {SELECTIVE}", {}),
    "dp2_zero3_recompute_full": ("gpt2", "--zero-stage 3 --recompute-granularity full --recompute-method uniform "
                                         "--recompute-num-layers 1", {}),
    # fp8: one step (two micro-batches per rank, the update, the gathered result). Over more steps
    # the last-bit differences of another reduction order flip some fp8 roundings, and AdamW's
    # normalised updates carry those differences on, as they would between any two fp8 runs.
    "dp2_ddp_fp8_hybrid": ("gpt2", "", dict(fp8="hybrid", steps=1)),
    "dp2_zero2_fp8_e4m3": ("llama", "--zero-stage 2", dict(fp8="e4m3", steps=1)),
    # megatrain's fp8 layers (weights cast once per step, float32 weight gradients added in place)
    # against torchao's in one process: the same recipe, so the same numbers
    "dp2_ddp_fp8_fused_hybrid": ("llama", "", dict(fp8="hybrid", fp8_fused=True, steps=1)),
    "tp2_fp8_hybrid": ("gpt2", "--tensor-model-parallel-size 2", dict(fp8="hybrid", steps=1)),
    "tp2_sp_fp8_e4m3": ("gpt2", "--tensor-model-parallel-size 2 --sequence-parallel", dict(fp8="e4m3", steps=1)),
}
# One process with --use-distributed-optimizer / --zero-stage: FSDP2 over a mesh of one rank.
WORLD1 = {
    "one_process_zero1": ("llama", "--use-distributed-optimizer", {}),
    "one_process_zero3": ("gpt2", "--zero-stage 3", {}),
    "one_process_grad_fusion": ("llama", "", dict(grad_fusion=True)),
    "one_process_fp8_fused_e4m3": ("gpt2", "", dict(fp8="e4m3", fp8_fused=True, steps=2)),
}
WORLD4 = {
    "tp2_dp2": ("gpt2", "--tensor-model-parallel-size 2", {}),
    "tp2_dp2_fused_adamw": ("llama", "--tensor-model-parallel-size 2", dict(fused_adamw=True)),
    "tp2_sp_dp2_zero3_selective": ("llama", f"--tensor-model-parallel-size 2 --sequence-parallel --zero-stage 3 "
                                            f"{SELECTIVE}", {}),
}


@pytest.fixture(scope="module")
def world1():
    return run_layouts(WORLD1, 1)


@pytest.fixture(scope="module")
def world2():
    return run_layouts(WORLD2, 2)


@pytest.fixture(scope="module")
def world4():
    return run_layouts(WORLD4, 4)


def _check(world: tuple[dict, list[dict]], name: str, layout: tuple) -> None:
    references, results = world
    _, flags, kwargs = layout
    for rank, per_rank in enumerate(results):
        run = per_rank[name]
        r = compare(run, references[name])
        assert r["loss"] < TOLERANCE, f"rank {rank}: per-step loss differs from one process by {r['loss']:.2e}"
        assert r["params"] < TOLERANCE, f"rank {rank}: final parameters differ from one process by {r['params']:.2e}"
        assert max(run.grad_norms) > CLIP, "gradient clipping was not active; the check would be weaker"
        info = run.info
        assert info["homogeneous_groups"], "an optimizer group mixes plain tensors and DTensors"
        assert info["fp8_layers"] == (8 if kwargs.get("fp8") else 0), "fp8 linear layers"
        fused_fp8 = kwargs.get("fp8_fused", False)
        assert info["fused_linears"] == (8 if kwargs.get("grad_fusion") and not fused_fp8 else 0), \
            "gradient-accumulation fusion layers"
        assert info["fp8_fused_layers"] == (8 if fused_fp8 else 0), "fp8 layers on the fusion's protocol"
        assert info["chunks"] == ("--cross-entropy-chunk-size" in flags), "the chunked loss"
        assert info["fused_adamw"] == kwargs.get("fused_adamw", False), "fused AdamW kernels"
        if "unsynced" in info:
            assert info["unsynced"], "gradients were reduced on a micro-batch that should not synchronise"
        if "kept_unsharded" in info:
            assert info["kept_unsharded"], "ZeRO-1/2 resharded the parameters between micro-batches"
        data_parallel = len(results) // (2 if "--tensor-model-parallel-size 2" in flags else 1) > 1
        assert ("unsynced" in info) == data_parallel, "the first micro-batch's gradients were not looked at"
        zero12 = any(f in flags for f in ("--use-distributed-optimizer", "--zero-stage 1", "--zero-stage 2"))
        assert ("kept_unsharded" in info) == zero12, "the first micro-batch's parameters were not looked at"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_world2_layout_matches_one_process(world2, name):
    _check(world2, name, WORLD2[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD1))
def test_one_process_sharded_optimizer_matches_plain_process(world1, name):
    _check(world1, name, WORLD1[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4))
def test_world4_layout_matches_one_process(world4, name):
    _check(world4, name, WORLD4[name])
