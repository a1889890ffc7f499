"""The engine's CUDA-graph decode against its eager decode (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from megatrain.inference.engine.api import GenerateJob, Sampling
from megatrain.inference.engine.engine import EngineConfig, GenerationEngine, generate_blocking
from megatrain.inference.engine.runner import ModelRunner
from megatrain.inference.engine.slot_cache import CacheShape, SlotKVCache
from megatrain.inference.generation import generate
from megatrain.models.common.attention import SelfAttention

from tests.unit.test_engine_slot_cache import VOCAB, make_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 17, 3, 9, 22, 40, 1], [8, 2], [30, 31, 32, 33], [9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def cuda_model(style: str, dtype: torch.dtype = torch.float32):
    return make_model(style).to("cuda", dtype)


def runner_of(model, cuda_graphs: bool, length_bucket: int = 8) -> ModelRunner:
    layers = tuple(m.layer_number for m in model.modules() if isinstance(m, SelfAttention))
    shape = CacheShape(layers, model.config.num_query_groups, model.config.kv_channels, 6, 40)
    dtype = next(model.parameters()).dtype
    cache = SlotKVCache(shape, dtype, torch.device("cuda"))
    return ModelRunner(model, cache, torch.device("cuda"), cuda_graphs=cuda_graphs, length_bucket=length_bucket)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_graph_decode_equals_eager_decode(style, dtype):
    model = cuda_model(style, dtype)
    eager, graphed = runner_of(model, False), runner_of(model, True)
    lengths = {}
    for slot, prompt in zip([0, 2, 1], PROMPTS[:3]):
        for runner in (eager, graphed):
            runner.prefill([(slot, prompt)])
        lengths[slot] = len(prompt)
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for step in range(12):  # crosses the key-length buckets 8 and 16; 3 rows padded to the bucket of 4
        tokens = [(5 * slot + step) % VOCAB for slot in range(3)]
        positions = [lengths[slot] for slot in range(3)]
        needed = max(positions) + 1
        a = eager.decode(tokens, positions, needed)
        b = graphed.decode(tokens, positions, needed)
        torch.testing.assert_close(b.float(), a.float(), **tolerance)
        for slot in range(3):
            lengths[slot] += 1
    assert set(graphed._graphs) == {(4, 8), (4, 16), (4, 32)}


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_graph_engine_equals_generate(style):
    model = cuda_model(style)
    expected = [generate(model, [p], 10)[0] for p in PROMPTS]
    results = {}
    for graphs in (False, True):
        engine = GenerationEngine(model, EngineConfig(max_requests=3, max_sequence_length=40, cuda_graphs=graphs,
                                                      length_bucket=8))
        try:
            events = generate_blocking(engine, [GenerateJob(p, 10, Sampling(greedy=True)) for p in PROMPTS])
        finally:
            engine.close()
        results[graphs] = [[e.token for e in job] for job in events]
    assert results[False] == expected
    assert results[True] == expected


def test_capture_all_and_seeded_sampling_on_cuda():
    model = cuda_model("llama")
    engine = GenerationEngine(model, EngineConfig(max_requests=5, max_sequence_length=40, length_bucket=16))
    try:
        assert engine.runner.cuda_graphs
        decode_graphs = len(engine.runner.batch_buckets) * len(engine.runner.length_buckets)
        assert engine.runner.capture_all() == decode_graphs + len(engine.runner.static_prefill.token_buckets)
        job = GenerateJob(PROMPTS[0], 12, Sampling(temperature=1.2, top_p=0.95, seed=5))
        (alone,) = generate_blocking(engine, [job])
        crowded = generate_blocking(engine, [GenerateJob(p, 12, Sampling(seed=i)) for i, p in enumerate(PROMPTS)]
                                    [:2] + [job])
    finally:
        engine.close()
    assert [e.token for e in crowded[2]] == [e.token for e in alone]


@pytest.mark.parametrize("jobs", [3, 1])  # one job: the batch-1 graph, whose matmuls gemv_tuning rewrites
@pytest.mark.parametrize("gemv_tuning", [True, False])
def test_compiled_graph_engine_equals_generate(jobs, gemv_tuning):
    model = cuda_model("llama")
    prompts = PROMPTS[:jobs]
    expected = [generate(model, [p], 10)[0] for p in prompts]
    engine = GenerationEngine(model, EngineConfig(max_requests=3, max_sequence_length=40, length_bucket=8,
                                                  compile_decode=True, gemv_tuning=gemv_tuning))
    try:
        assert engine.runner.cuda_graphs
        events = generate_blocking(engine, [GenerateJob(p, 10, Sampling(greedy=True)) for p in prompts])
    finally:
        engine.close()
    assert [[e.token for e in job] for job in events] == expected


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_graph_steps_run_ahead_and_equal_step_by_step(style):
    """Greedy graph replays launched from the previous step's device tokens (lookahead) choose the
    tokens that step-by-step decoding chooses, across length buckets and jobs ending at different steps."""
    model = cuda_model(style)
    jobs = [GenerateJob(p, n, Sampling(greedy=True)) for p, n in zip(PROMPTS, [20, 9, 30, 3, 17])]

    def run(lookahead: bool):
        engine = GenerationEngine(model, EngineConfig(max_requests=3, max_sequence_length=48, length_bucket=8,
                                                      lookahead=lookahead))
        try:
            return [[e.token for e in job] for job in generate_blocking(engine, jobs)], engine.steps_ahead
        finally:
            engine.close()

    (ahead, steps), (in_step, _) = run(True), run(False)
    assert steps > 0 and ahead == in_step
    assert ahead == [generate(model, [job.prompt_ids], job.max_new_tokens)[0] for job in jobs]


def test_graphs_recorded_at_start_serve_every_bucket_without_recording():
    """``capture_graphs_at_start`` (the server's setting): every (batch, key-length) graph exists before
    the first job's tokens, and a load across buckets records none later."""
    model = cuda_model("llama")
    expected = [generate(model, [p], 14)[0] for p in PROMPTS]
    engine = GenerationEngine(model, EngineConfig(max_requests=4, max_sequence_length=40, length_bucket=8,
                                                  capture_graphs_at_start=True))
    try:
        (first,) = generate_blocking(engine, [GenerateJob(PROMPTS[0], 2, Sampling(greedy=True))])
        count = len(engine.runner.batch_buckets) * len(engine.runner.length_buckets)
        prefill_graphs = len(engine.runner.static_prefill.token_buckets)
        assert len(engine.runner._graphs) == count and len(engine.runner.static_prefill._shapes) == prefill_graphs
        assert engine.stats.graphs == count + prefill_graphs and engine.stats.capture_s > 0
        events = generate_blocking(engine, [GenerateJob(p, 14, Sampling(greedy=True)) for p in PROMPTS])
        assert len(engine.runner._graphs) == count
    finally:
        engine.close()
    assert [e.token for e in first] == expected[0][:2]
    assert [[e.token for e in job] for job in events] == expected
    assert engine.stats.decode_steps > 0 and engine.stats.prefills == len(PROMPTS) + 1
