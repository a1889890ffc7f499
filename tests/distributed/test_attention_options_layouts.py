"""The attention options of Qwen3 and Mistral train under the parallel layouts exactly like one process.

``--qk-layernorm`` (a norm of width ``--kv-channels`` over each head's queries and keys, shared by
all heads) under tensor parallelism, with and without sequence parallelism: each rank normalises
its own heads with the replicated norm weights, whose gradients must sum every rank's heads. The
LLaMA-style tiny model (RMSNorm: a weight) and the GPT-2 style one (LayerNorm: a weight and a bias;
with rotary positions), with a head dim apart from hidden / heads. ``--window-size 3,0`` (sliding window, narrower than a
context-parallel chunk's reach across chunks) under context parallelism: each rank's load-balanced
query chunks against the whole sequence's keys, windowed by global position; with four processes
also CP=2 x TP=2 (sequence parallel) with both options.

The real trainer (``Trainer.train_step``, 3 iterations of 4 micro-batches, active gradient
clipping, AdamW) of :mod:`dist_harness` on gloo CPU processes, against the same model in one plain
process: per-step losses, gradient norms and the final gathered parameters within 1e-5 relative
error. The layouts of one world size and their references share one spawned job.
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
QK = "--qk-layernorm --kv-channels 12"
# GPT-2 style with rotary positions: without them a bias added to every key moves each query's scores
# by one constant, so the key norm's bias has no gradient and AdamW would make updates of float noise.
GPT2_ROPE = "--position-embedding-type rope"
WINDOW = "--window-size 3,0"
TP2 = "--tensor-model-parallel-size 2"
CP2 = "--context-parallel-size 2"

# name -> (model style, model flags (the reference's too), layout flags)
WORLD2 = {
    "qk_layernorm_tp2_llama": ("llama", QK, TP2),
    "qk_layernorm_tp2_sp_llama": ("llama", QK, f"{TP2} --sequence-parallel"),
    "qk_layernorm_tp2_sp_gpt2_rope": ("gpt2", f"{QK} {GPT2_ROPE}", f"{TP2} --sequence-parallel"),
    "window_cp2_llama": ("llama", WINDOW, CP2),
}
WORLD4 = {
    "window_qk_layernorm_cp2_tp2_sp_llama": ("llama", f"{WINDOW} {QK}", f"{CP2} {TP2} --sequence-parallel"),
}


def _train(style: str, model: str, layout: str) -> Run:
    from megatrain.training.arguments import parse_args

    args = parse_args([*model_flags(style), *shlex.split(model), *run_flags(STEPS), *shlex.split(layout)])
    trainer = HarnessTrainer(args)
    try:
        results = [trainer.train_step() for _ in range(STEPS)]
        return Run([r.loss for r in results], [r.grad_norm for r in results], full_parameters(trainer.module), {})
    finally:
        trainer.close()


def _references(layouts: dict[str, tuple[str, str, str]]) -> dict[str, Run]:
    done: dict[tuple[str, str], Run] = {}
    for style, model, _ in layouts.values():
        if (style, model) not in done:
            done[(style, model)] = _train(style, model, "")
    return {name: done[(style, model)] for name, (style, model, _) in layouts.items()}


def _layouts(rank: int, world_size: int, layouts: dict[str, tuple[str, str, str]]) -> dict[str, Run]:
    return {name: _train(style, model, layout) for name, (style, model, layout) in layouts.items()}


def _run(layouts: dict[str, tuple[str, str, str]], world_size: int) -> tuple[dict[str, Run], list[dict[str, Run]]]:
    return run_alone_then_workers(functools.partial(_references, layouts), _layouts, world_size, layouts)


@pytest.fixture(scope="module")
def world2():
    return _run(WORLD2, 2)


@pytest.fixture(scope="module")
def world4():
    return _run(WORLD4, 4)


def _check(world: tuple[dict[str, Run], list[dict[str, Run]]], name: str) -> None:
    references, results = world
    reference = references[name]
    for rank, per_rank in enumerate(results):
        run = per_rank[name]
        errors: dict[str, Any] = compare(run, reference)
        errors["grad_norm"] = max(abs(a - b) / abs(b) for a, b in zip(run.grad_norms, reference.grad_norms,
                                                                        strict=True))
        for what, error in errors.items():
            assert error < TOLERANCE, f"rank {rank}: {what} differs from one process by {error:.2e}"
        assert max(run.grad_norms) > CLIP, "gradient clipping was not active; the check would be weaker"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_attention_option_on_two_processes_equals_one_process(world2, name):
    _check(world2, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4))
def test_attention_options_under_cp2_tp2_equal_one_process(world4, name):
    _check(world4, name)
