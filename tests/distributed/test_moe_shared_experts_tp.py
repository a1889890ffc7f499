"""A MoE layer's shared experts (with their gate) under tensor parallelism train like one process.

The real trainer on 2 gloo CPU processes (the tiny LLaMA-style MoE model of :mod:`moe_harness` plus
``--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate``) with TP=2, with and without
sequence parallelism, against the same run in one process: per-step losses, gradient norms and final
parameters within 1e-5. Under sequence parallelism each rank routes its part of the sequence and the
shared experts gather it in their column-parallel fc1; the gate's weight gradient sums the ranks' parts
(``SharedExpertGateParallel``; without it the parameters drift by ~6e-2 here).
"""

from __future__ import annotations

import pytest

from dist_harness import max_relative_error
from moe_harness import run_moe_layouts

TOLERANCE = 1e-5
SHARED = "--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate"
LAYOUTS = {
    "tp2_sp": ("llama", "--tensor-model-parallel-size 2 --sequence-parallel", SHARED, {}),
    "tp2": ("llama", "--tensor-model-parallel-size 2", SHARED, {}),
}


@pytest.fixture(scope="module")
def runs():
    return run_moe_layouts(LAYOUTS, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_shared_experts_under_tensor_parallel_match_one_process(runs, name):
    references, results = runs
    ref = references[name]
    assert any("shared_experts.gate_weight" in k for k in ref.params)
    for rank, per_rank in enumerate(results):
        run = per_rank[name]
        assert len(run.losses) == len(ref.losses) > 0
        loss = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses))
        norm = max(abs(a - b) / abs(b) for a, b in zip(run.grad_norms, ref.grad_norms))
        params = max_relative_error(run.params, ref.params)
        assert loss < TOLERANCE and norm < TOLERANCE, (rank, loss, norm)
        assert params < TOLERANCE, f"rank {rank}: final parameters differ from one process by {params:.2e}"
