"""Multi-latent attention (``--multi-latent-attention``) trains under the parallel layouts exactly like
one process.

Tensor parallelism splits the query and key/value up projections by heads and keeps the down
projections and the latent norms whole on every rank; the rotated key part every head shares enters
the rank's heads through a region whose gradient sums over the ranks (without it the replicated
``linear_kv_down_proj`` would get only this rank's heads' share). Sequence parallelism gathers the
layer input before the down projections. Context parallelism gathers the up-projected keys and
(narrower) values. Pipeline parallelism cuts between MLA layers. Both query forms: through a rank
``--q-lora-rank`` bottleneck (with its norm) and projected directly; YaRN RoPE with a softmax mscale.

The real trainer (3 iterations of 4 micro-batches, active gradient clipping, AdamW) of
:mod:`dist_harness` on gloo CPU processes, against the same model in one process: per-step losses,
gradient norms and the final gathered parameters (a pipeline rank's: its stage's) within 1e-5 relative
error.
"""

from __future__ import annotations

import functools

import pytest

from dist_harness import assert_equals_reference, run_flag_layouts, train_flags

STEPS = 3
MLA = ("--multi-latent-attention --kv-lora-rank 12 --qk-head-dim 8 --qk-pos-emb-head-dim 4 --v-head-dim 6 "
       "--qk-layernorm --rotary-scaling-factor 4 --mscale 0.8 --mscale-all-dim 0.707 "
       "--yarn-original-max-position-embeddings 8")
Q_LORA = f"{MLA} --q-lora-rank 16"
TP2 = "--tensor-model-parallel-size 2"

# name -> (model flags (the reference's too), layout flags)
WORLD2 = {
    "mla_q_lora_tp2": (Q_LORA, TP2),
    "mla_q_lora_tp2_sp": (Q_LORA, f"{TP2} --sequence-parallel"),
    "mla_direct_q_tp2_sp": (MLA, f"{TP2} --sequence-parallel"),
    "mla_q_lora_cp2": (Q_LORA, "--context-parallel-size 2"),
    "mla_q_lora_pp2": (Q_LORA, "--pipeline-model-parallel-size 2"),
    "mla_q_lora_dp2_zero1": (Q_LORA, "--use-distributed-optimizer"),
}


_train = functools.partial(train_flags, "gpt2", steps=STEPS)


@pytest.fixture(scope="module")
def world2():
    return run_flag_layouts(_train, WORLD2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_mla_layout_on_two_processes_equals_one_process(world2, name):
    references, results = world2
    for rank, per_rank in enumerate(results):
        assert_equals_reference(per_rank[name], references[name], rank)
