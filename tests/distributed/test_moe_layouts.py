"""Expert-parallel layouts train a mixture-of-experts model exactly like one process.

The real trainer (``Trainer.train``, 5 iterations of 4 micro-batches, active gradient clipping,
AdamW) on gloo CPU processes with the tiny MoE model of :mod:`moe_harness` (4 experts, top-2,
dropless), against the same run in one plain process: per-step losses, gradient norms and the final
gathered parameters within 1e-5 relative error; with --moe-aux-loss-coeff the logged
load_balancing_loss too. Layouts: EP=2 with each dispatcher (Megatron's flex, with its HybridEP backend
named, runs as alltoall: the same losses bit for bit), EP=2 x TP=2 (sequence parallel, with
and without the balancing loss), EP=1 x TP=2 (sequence parallel), EP=2 with GELU experts with biases
and --moe-layer-recompute, EP=2 x TP=2 (SP) with expert-bias balancing and the global balancing loss
(the biases equal one process's too), EP=2 x TP=2 (SP) with gated shared experts, EP=2 with ZeRO-3, EP=2 x CP=2 with the balancing loss; on 4 processes EP=4, EP=2 x DP=2 with ZeRO-1 (two expert-data-parallel
replicas), EP=2 x PP=2 with the balancing loss, EP=2 x TP=2 (SP) x DP=2, and checkpoints: an EP=4 run saved after 2 iterations resumes bit for bit
under EP=4 and within float rounding under EP=1 (data parallel 4); an EP=1 checkpoint continues
under EP=2. All layouts of one world size and their references share one spawned job.
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import CLIP, STEPS, compare, max_relative_error
from moe_harness import run_moe_layouts

from megatrain.training.logging import parse_train_log_line

TOLERANCE = 1e-5
EP2 = "--expert-model-parallel-size 2"
A2A = "--moe-token-dispatcher-type alltoall"
FLEX = "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep"
TP2_SP = "--tensor-model-parallel-size 2 --sequence-parallel"
AUX = "--moe-aux-loss-coeff 1e-2"
# aux-loss-free balancing (biases moved by the token counts of all ranks) with the global balancing loss
BIAS_GLOBAL = ("--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.05 "
               "--moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 1e-2")
HALF = 2

# name -> (model style, layout flags, run flags (the reference's too), train_moe keyword arguments)
WORLD2 = {
    "ep2_alltoall": ("llama", f"{EP2} {A2A}", "", {}),
    "ep2_allgather": ("llama", EP2, "", {}),
    "ep2_flex": ("llama", f"{EP2} {FLEX}", "", {}),
    "ep2_tp2_sp_alltoall": ("llama", f"{EP2} {TP2_SP} {A2A}", "", {}),
    "ep2_tp2_sp_aux_loss": ("llama", f"{EP2} {TP2_SP}", AUX, {}),
    "ep2_tp2_sp_expert_bias_global_aux": ("llama", f"{EP2} {TP2_SP} {A2A}", BIAS_GLOBAL, {}),
    "ep1_tp2_sp": ("llama", TP2_SP, "", {}),
    "ep2_gelu_bias_moe_recompute": ("gpt2", f"{EP2} {A2A} --moe-layer-recompute", "", {}),
    "ep2_zero3_allgather": ("llama", f"{EP2} --zero-stage 3", "", {}),
    "ep2_tp2_sp_shared_experts_gate": ("llama", f"{EP2} {TP2_SP} {A2A}",
                                       "--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate", {}),
    "ep2_cp2_aux_loss": ("llama", f"{EP2} {A2A} --context-parallel-size 2", AUX, {}),
}


WORLD4_LAYOUTS = ["ep4_alltoall", "ep2_dp2_zero1", "ep2_pp2_aux_loss", "ep2_tp2_sp_dp2"]


def _world4(root: str) -> tuple[dict, dict]:
    ep4, ep1 = f"--expert-model-parallel-size 4 {A2A}", ""
    first = f"--exit-interval {HALF}"
    layouts = {
        "ep4_alltoall": ("llama", ep4, "", {}),
        "ep2_dp2_zero1": ("llama", f"{EP2} {A2A} --use-distributed-optimizer", "", {}),
        "ep2_pp2_aux_loss": ("llama", f"{EP2} {A2A} --pipeline-model-parallel-size 2", AUX, {}),
        "ep2_tp2_sp_dp2": ("llama", f"{EP2} {TP2_SP}", "", {}),
        # checkpoints (in this order): EP=4 saves, resumes under EP=4 and EP=1; EP=1 saves, EP=2 resumes
        "ep4_first_half": ("llama", ep4, f"--save {root}/ep4 {first}", {}),
        "ep4_resumed": ("llama", ep4, f"--load {root}/ep4", {}),
        "ep4_into_ep1": ("llama", ep1, f"--load {root}/ep4", {}),
        "ep1_first_half": ("llama", ep1, f"--save {root}/ep1 {first}", {}),
        "ep1_into_ep2": ("llama", f"{EP2} {A2A}", f"--load {root}/ep1", {}),
    }
    plain = ("llama", "", "", {})
    references = {name: (layout if name in WORLD4_LAYOUTS else plain)
                  for name, layout in layouts.items()}
    return layouts, references


@pytest.fixture(scope="module")
def world2():
    return run_moe_layouts(WORLD2, 2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    layouts, references = _world4(str(tmp_path_factory.mktemp("moe_ckpt")))
    return run_moe_layouts(layouts, 4, references)


def _logged(run, name: str) -> list[float]:
    return [parse_train_log_line(line)[name] for line in run.info["log"].splitlines() if "] iteration " in line]


def _check_balancing_loss(run, reference, name: str = "load_balancing_loss") -> None:
    logged, ref = _logged(run, name), _logged(reference, name)
    assert len(logged) == STEPS and all(v > 0 for v in ref)
    assert logged == pytest.approx(ref, rel=TOLERANCE), "the logged balancing loss depends on the layout"


def _check(run, reference, rank: int, *, steps: slice = slice(None)) -> None:
    ref_losses, ref_norms = reference.losses[steps], reference.grad_norms[steps]
    assert len(run.losses) == len(ref_losses) > 0
    loss = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref_losses))
    norm = max(abs(a - b) / abs(b) for a, b in zip(run.grad_norms, ref_norms))
    # a pipeline rank holds its stage's parameters
    params = max_relative_error(run.params, {k: reference.params[k] for k in run.params})
    assert loss < TOLERANCE, f"rank {rank}: per-step loss differs from one process by {loss:.2e}"
    assert norm < TOLERANCE, f"rank {rank}: gradient norm differs from one process by {norm:.2e}"
    assert params < TOLERANCE, f"rank {rank}: final parameters differ from one process by {params:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_world2_moe_layout_matches_one_process(world2, name):
    references, results = world2
    for rank, per_rank in enumerate(results):
        run = per_rank[name]
        _check(run, references[name], rank)
        assert max(run.grad_norms) > CLIP, "gradient clipping was not active; the check would be weaker"
        flags = WORLD2[name][1]
        ep = 2 if EP2 in flags else 1
        assert run.info["dispatcher"] == {1: "ScaledGradDispatcher" if "--sequence-parallel" in flags else
                                          "LocalDispatcher", 2: "AllToAllDispatcher" if A2A in flags or FLEX in flags
                                          else "AllGatherDispatcher"}[ep]
        if name == "ep2_flex":  # runs as alltoall: the same numbers exactly
            alltoall = per_rank["ep2_alltoall"]
            assert (run.losses, run.grad_norms) == (alltoall.losses, alltoall.grad_norms)
        # FSDP2 over edp shards the ep rank's experts: 4 / (ep x edp) = 2 on 2 ranks
        assert run.info["expert_mesh"] == (("edp", "ep") if ep > 1 else ("edp",)) and run.info["local_experts"] == 2
        if WORLD2[name][2] == AUX and rank == len(results) - 1:  # the last rank prints the log lines
            _check_balancing_loss(run, references[name])
        if WORLD2[name][2] == BIAS_GLOBAL:
            if rank == len(results) - 1:
                _check_balancing_loss(run, references[name], "global_load_balancing_loss")
            biases, ref = run.info["expert_bias"], references[name].info["expert_bias"]
            assert biases.keys() == ref.keys() and len(ref) == 2 and all(b.abs().sum() > 0 for b in ref.values())
            for key in ref:
                assert torch.equal(biases[key], ref[key]), f"rank {rank}: {key} differs from one process"


@pytest.mark.slow
@pytest.mark.parametrize("name", WORLD4_LAYOUTS)
def test_world4_moe_layout_matches_one_process(world4, name):
    references, results = world4
    for rank, per_rank in enumerate(results):
        run = per_rank[name]
        _check(run, references[name], rank)
        # 4 experts / (ep x edp): EP=4; EP=2 over dp 4 (ZeRO-1, edp 2); EP=2 x PP=2 (edp 1)
        assert run.info["local_experts"] == (2 if "pp2" in name else 1) and run.info["expert_mesh"] == ("edp", "ep")
    if "aux" in name:  # every iteration's value (the pipeline's metadata inference counts no micro-batch)
        _check_balancing_loss(results[-1][name], references[name])


@pytest.mark.slow
def test_moe_checkpoints_resume_exactly_and_under_another_expert_parallel_size(world4):
    references, results = world4
    full = references["ep4_resumed"]  # one process, all iterations
    for rank, runs in enumerate(results):
        uninterrupted = runs["ep4_alltoall"]
        assert len(runs["ep4_first_half"].losses) == HALF
        assert runs["ep4_first_half"].losses == uninterrupted.losses[:HALF]
        resumed = runs["ep4_resumed"]
        # same layout: bit for bit
        assert resumed.losses == uninterrupted.losses[HALF:], f"rank {rank}: EP=4 resume is not exact"
        assert resumed.grad_norms == uninterrupted.grad_norms[HALF:]
        assert max_relative_error(resumed.params, uninterrupted.params) == 0.0
        # another expert-parallel size: the continued run equals one process's within rounding
        _check(runs["ep4_into_ep1"], full, rank, steps=slice(HALF, None))
        _check(runs["ep1_into_ep2"], full, rank, steps=slice(HALF, None))
