"""BERT under every parallel layout trains exactly like one process: per-step losses (``lm loss`` and
``sop loss``), the validation losses and the final parameters, within 1e-5 relative error.

The real trainer built from ``pretrain_bert.py``'s flags (tiny model, 4 micro-batches per global
batch, active clipping, AdamW) on gloo CPU processes; the samples are synthetic masked-LM samples
with padding, token types and sentence-order labels (:mod:`bert_harness`).
"""

from __future__ import annotations

import pytest

from bert_harness import run_bert_layouts
from dist_harness import max_relative_error

TOLERANCE = 1e-5
FULL_RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"

WORLD2 = {
    "dp2_ddp": ("--overlap-grad-reduce --ddp-bucket-size 10000", {}),
    "dp2_zero1": ("--use-distributed-optimizer", {}),
    "dp2_chunked_loss_with_bias": ("--cross-entropy-chunk-size 8", {}),
    "dp2_zero2": ("--zero-stage 2", {}),
    "dp2_zero3_recompute_full": (f"--zero-stage 3 {FULL_RECOMPUTE}", {}),
    "tp2": ("--tensor-model-parallel-size 2", {}),
    "tp2_sp": ("--tensor-model-parallel-size 2 --sequence-parallel", {}),
    "tp2_sp_no_binary_head": ("--tensor-model-parallel-size 2 --sequence-parallel", dict(binary_head=False)),
    "tp2_untied_selective": ("--tensor-model-parallel-size 2 --recompute-granularity selective",
                             dict(model="--untie-embeddings-and-output-weights")),
    "pp2_1f1b": ("--pipeline-model-parallel-size 2", {}),
    "pp2_interleaved": ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1",
                        dict(num_layers=4)),
    "pp2_untied_no_binary_head": ("--pipeline-model-parallel-size 2",
                                  dict(binary_head=False, model="--untie-embeddings-and-output-weights")),
}
WORLD4 = {
    "tp2_sp_pp2": ("--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2", {}),
    "tp2_dp2_zero1": ("--tensor-model-parallel-size 2 --use-distributed-optimizer", {}),
    "pp2_dp2_zero3": ("--pipeline-model-parallel-size 2 --zero-stage 3", {}),
}


def _check(name, reference, runs):
    for rank, run in enumerate(runs):
        run = run[name]
        # Every rank reports the step's losses (the pipeline shares the last stage's).
        for got, want in zip(run.info["per_loss"], reference.info["per_loss"], strict=True):
            assert set(got) == set(want) == set(reference.info["names"])
            for loss in want:
                assert got[loss] == pytest.approx(want[loss], rel=TOLERANCE), (name, rank, loss)
        assert run.eval_loss == pytest.approx(reference.eval_loss, rel=TOLERANCE), (name, rank)
        params = {k: v for k, v in run.params.items()}
        # A pipeline rank holds its stages' parameters (the last stage's copy of the tied embedding too).
        assert params and set(params) <= set(reference.params), (name, sorted(set(params) - set(reference.params)))
        assert max_relative_error(params, {k: reference.params[k] for k in params}) < TOLERANCE, (name, rank)


@pytest.fixture(scope="module")
def world2():
    return run_bert_layouts(WORLD2, 2)


@pytest.fixture(scope="module")
def world4():
    return run_bert_layouts(WORLD4, 4)


@pytest.mark.parametrize("name", sorted(WORLD2))
def test_bert_layout_on_two_processes_equals_one_process(world2, name):
    references, runs = world2
    _check(name, references[name], runs)


@pytest.mark.parametrize("name", sorted(WORLD4))
def test_bert_layout_on_four_processes_equals_one_process(world4, name):
    references, runs = world4
    _check(name, references[name], runs)


def test_the_pipeline_ranks_together_hold_every_parameter(world2):
    references, runs = world2
    for name in ("pp2_1f1b", "pp2_interleaved"):
        held = set(runs[0][name].params) | set(runs[1][name].params)
        assert held == set(references[name].params)
