"""Multi-token prediction (``--mtp-num-layers``) trains under the parallel layouts exactly like one process.

Data parallelism (replicated, and ZeRO-3 with ``--calculate-per-token-loss``, where each depth's loss is
re-weighted by the micro-batch's token counts), context parallelism (the shifted tokens, labels and
masks come from the whole sequence, so a rank's part predicts tokens held by the other rank), pipeline
parallelism (the depths on the last stage, which keeps a copy of the word embeddings also when the
output layer is untied; the copies' gradients are summed) and expert parallelism (a MoE model's depth
is a MoE layer, like its last layer), tensor parallelism with and without sequence parallelism (the
depths' layers split like the decoder's, their norms and projection on the rank's part of the sequence), and
full recomputation (the depths' layers recomputed too).

The real trainer (3 iterations of 4 micro-batches with ``--eod-mask-loss``, active gradient clipping,
AdamW) of :mod:`dist_harness` on gloo CPU processes, against the same model in one process: per-step
losses, gradient norms and the final gathered parameters (a pipeline rank's: its stage's) within 1e-5
relative error.
"""

from __future__ import annotations

import pytest

from dist_harness import HarnessTrainer, Run, assert_equals_reference, run_flag_layouts, train_flags

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
    "mtp_dp2_full_recompute": (MTP, "--recompute-granularity full --recompute-method uniform"),
}


def _built(layout: str, trainer: HarnessTrainer) -> None:
    assert trainer.mtp_metrics is not None
    if "--tensor-model-parallel-size" in layout:  # the depths' layers are split like the decoder's
        from torch.distributed.tensor import DTensor

        depth = trainer.module.mtp.layers["1"]
        assert isinstance(depth.transformer_layer.self_attention.linear_qkv.weight, DTensor)
        assert isinstance(depth.eh_proj.weight, DTensor) == ("--sequence-parallel" in layout)


def _train(model: str, layout: str) -> Run:
    return train_flags("llama", model, layout, STEPS, check=lambda trainer: _built(layout, trainer))


@pytest.fixture(scope="module")
def world2():
    return run_flag_layouts(_train, WORLD2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_mtp_layout_on_two_processes_equals_one_process(world2, name):
    references, results = world2
    for rank, per_rank in enumerate(results):
        run = per_rank[name]
        if "pp2" in name and rank == 1:  # the last stage: the depths and its copy of the word embeddings
            assert any(k.startswith("mtp.layers.1.") for k in run.params)
            assert "embedding.word_embeddings.weight" in run.params
        assert_equals_reference(run, references[name], rank)
