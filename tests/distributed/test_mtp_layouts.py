"""Multi-token prediction (``--mtp-num-layers``) trains under the parallel layouts exactly like one process.

Data parallelism (replicated, and ZeRO-3 with ``--calculate-per-token-loss``, where each depth's loss is
re-weighted by the micro-batch's token counts), context parallelism (the shifted tokens, labels and
masks come from the whole sequence, so a rank's part predicts tokens held by the other rank), pipeline
parallelism (the depths on the last stage, which keeps a copy of the word embeddings also when the
output layer is untied; the copies' gradients are summed) and expert parallelism (a MoE model's depth
is a MoE layer, like its last layer), tensor parallelism with and without sequence parallelism (the
depths' layers split like the decoder's, their norms and projection on the rank's part of the sequence).

The real trainer (3 iterations of 4 micro-batches with ``--eod-mask-loss``, active gradient clipping,
AdamW) of :mod:`dist_harness` on gloo CPU processes, against the same model in one process: per-step
losses, gradient norms and the final gathered parameters (a pipeline rank's: its stage's) within 1e-5
relative error.
"""

from __future__ import annotations

import functools
import shlex
from typing import Any

import pytest

from dist_harness import CLIP, HarnessTrainer, Run, compare, full_parameters, model_flags, run_alone_then_workers, \
    run_flags

TOLERANCE = 1e-5
STEPS = 3
MTP = "--mtp-num-layers 2 --mtp-loss-scaling-factor 0.3"
MOE = f"{MTP} --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 --moe-aux-loss-coeff 1e-2"

# name -> (model flags (the reference's too), layout flags)
WORLD2 = {
    "mtp_dp2": (MTP, ""),
    "mtp_dp2_zero3_per_token": (f"{MTP} --calculate-per-token-loss", "--zero-stage 3"),
    "mtp_cp2": (MTP, "--context-parallel-size 2"),
    "mtp_pp2_untied": (MTP, "--pipeline-model-parallel-size 2"),
    "mtp_moe_ep2": (MOE, "--expert-model-parallel-size 2"),
    "mtp_tp2": (MTP, "--tensor-model-parallel-size 2"),
    "mtp_tp2_sp": (MTP, "--tensor-model-parallel-size 2 --sequence-parallel"),
}


def _train(model: str, layout: str) -> Run:
    from megatrain.training.arguments import parse_args

    args = parse_args([*model_flags("llama"), *shlex.split(model), *run_flags(STEPS), *shlex.split(layout)])
    trainer = HarnessTrainer(args)
    try:
        results = [trainer.train_step() for _ in range(STEPS)]
        assert trainer.mtp_metrics is not None
        if "--tensor-model-parallel-size" in layout:  # the depths' layers are split like the decoder's
            from torch.distributed.tensor import DTensor

            depth = trainer.module.mtp.layers["1"]
            assert isinstance(depth.transformer_layer.self_attention.linear_qkv.weight, DTensor)
            assert isinstance(depth.eh_proj.weight, DTensor) == ("--sequence-parallel" in layout)
        return Run([r.loss for r in results], [r.grad_norm for r in results], full_parameters(trainer.module), {})
    finally:
        trainer.close()


def _references(layouts: dict[str, tuple[str, str]]) -> dict[str, Run]:
    done: dict[str, Run] = {}
    for model, _ in layouts.values():
        if model not in done:
            done[model] = _train(model, "")
    return {name: done[model] for name, (model, _) in layouts.items()}


def _layouts(rank: int, world_size: int, layouts: dict[str, tuple[str, str]]) -> dict[str, Run]:
    return {name: _train(model, layout) for name, (model, layout) in layouts.items()}


@pytest.fixture(scope="module")
def world2():
    return run_alone_then_workers(functools.partial(_references, WORLD2), _layouts, 2, WORLD2)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_mtp_layout_on_two_processes_equals_one_process(world2, name):
    references, results = world2
    for rank, per_rank in enumerate(results):
        run, reference = per_rank[name], references[name]
        if "pp2" in name:  # a pipeline rank holds its stage's parameters only
            assert 0 < len(run.params) < len(reference.params)
            reference = Run(reference.losses, reference.grad_norms,
                            {k: v for k, v in reference.params.items() if k in run.params}, {})
            if rank == 1:  # the last stage: the depths and its copy of the word embeddings
                assert any(k.startswith("mtp.layers.1.") for k in run.params)
                assert "embedding.word_embeddings.weight" in run.params
        errors: dict[str, Any] = compare(run, reference)
        errors["grad_norm"] = max(abs(a - b) / abs(b) for a, b in zip(run.grad_norms, reference.grad_norms,
                                                                        strict=True))
        for what, error in errors.items():
            assert error < TOLERANCE, f"rank {rank}: {what} differs from one process by {error:.2e}"
        assert max(run.grad_norms) > CLIP, "gradient clipping was not active; the check would be weaker"
