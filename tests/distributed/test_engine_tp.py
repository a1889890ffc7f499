"""The generation engine under tensor parallelism (2 gloo CPU processes) against one process.

Rank 0 serves (greedy and seeded sampled jobs, a registered call whose JSON payload reaches every
rank), rank 1 follows the broadcast plans; the tokens and log-probabilities must equal the engine's
in one process on the same weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from dist_harness import run_alone_then_workers, tiny_config

from megatrain.inference.engine.api import GenerateJob, Sampling
from megatrain.inference.engine.engine import EngineConfig, GenerationEngine, generate_blocking
from megatrain.models.gpt import GPTModel
from megatrain.parallel.tensor_parallel import apply_tensor_parallel

PROMPTS = [[5, 17, 3, 9, 22, 40, 1], [8, 2], [30, 31, 32, 33], [9]]
CONFIG = EngineConfig(max_requests=3, max_sequence_length=16)


def _model(style: str) -> GPTModel:
    model = GPTModel(tiny_config(style, init_method_std=0.3))
    model.init_weights(seed=11)
    return model.eval()


def _jobs() -> list[GenerateJob]:
    greedy = [GenerateJob(p, 6, Sampling(greedy=True), top_logprobs=2) for p in PROMPTS]
    sampled = [GenerateJob(p, 6, Sampling(temperature=0.8, top_k=10, seed=7 + i)) for i, p in enumerate(PROMPTS[:2])]
    return greedy + sampled


def _summary(events) -> list[list[tuple[int, float, str | None]]]:
    return [[(e.token, e.logprob, e.finish_reason) for e in job] for job in events]


def _score(model, payload):
    with torch.no_grad():
        logits = model(torch.tensor([payload["ids"]]))
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {"argmax": int(logits[0, -1].argmax()), "seen": payload["ids"]}


def _alone() -> dict[str, list]:
    out = {}
    for style in ("gpt2", "llama"):
        engine = GenerationEngine(_model(style), CONFIG)
        try:
            out[style] = _summary(generate_blocking(engine, _jobs()))
        finally:
            engine.close()
    return out


def _worker(rank: int, world_size: int) -> dict[str, object]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out: dict[str, object] = {}
    for style in ("gpt2", "llama"):
        model = apply_tensor_parallel(copy.deepcopy(_model(style)), mesh)
        engine = GenerationEngine(model, CONFIG, group=mesh.get_group())
        seen: list[list[int]] = []

        def score(m, payload, seen=seen):
            seen.append(payload["ids"])
            return _score(m, payload)

        engine.register("score", score)
        if rank == 0:
            try:
                future = engine.call("score", {"ids": PROMPTS[0]})
                out[style] = _summary(generate_blocking(engine, _jobs()))
                out[f"{style}_call"] = future.result(60)
            finally:
                engine.close()
        else:
            engine.follow()
        out[f"{style}_seen"] = seen
    return out


@pytest.mark.slow
def test_engine_under_tensor_parallelism_equals_one_process():
    alone, ranks = run_alone_then_workers(_alone, _worker, 2)
    for style in ("gpt2", "llama"):
        tp, one = ranks[0][style], alone[style]
        assert [[(t, r) for t, _, r in job] for job in tp] == [[(t, r) for t, _, r in job] for job in one], style
        assert [lp for job in tp for _, lp, _ in job] == pytest.approx([lp for job in one for _, lp, _ in job], abs=1e-5)
        assert ranks[0][f"{style}_call"]["seen"] == PROMPTS[0]
        assert ranks[0][f"{style}_seen"] == ranks[1][f"{style}_seen"] == [PROMPTS[0]]
    greedy_reference = _summary_reference()
    assert [[t for t, _, _ in job] for job in alone["llama"][:len(PROMPTS)]] == greedy_reference


def _summary_reference() -> list[list[int]]:
    from megatrain.inference.generation import generate

    return [generate(_model("llama"), [p], 6)[0] for p in PROMPTS]
