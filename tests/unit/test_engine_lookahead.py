"""Greedy decode steps launched one step ahead of the host give the events of the engine that reads
every step's tokens before the next one (``EngineConfig(lookahead=False)``): the same tokens and
finish reasons, logprobs to float32 rounding (a job that ends is seen one step later, so a waiting
job joins one step later and the rows batched together, hence the summation order, differ)."""

from __future__ import annotations

import threading
import time

import pytest

from megatrain.inference.engine.api import GenerateJob, Sampling, TokenEvent
from megatrain.inference.engine.engine import EngineConfig, GenerationEngine, generate_blocking
from megatrain.inference.generation import generate

from tests.unit.test_engine_slot_cache import make_model

GREEDY = Sampling(greedy=True)


def _events(model, jobs, lookahead: bool, **config) -> tuple[list[list[TokenEvent]], int]:
    engine = GenerationEngine(model, EngineConfig(**{"max_requests": 3, "max_sequence_length": 40,
                                                     "lookahead": lookahead, **config}))
    try:
        return generate_blocking(engine, jobs), engine.steps_ahead
    finally:
        engine.close()


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_lookahead_events_equal_step_by_step_events(style):
    model = make_model(style)
    free = generate(model, [[4, 9, 1]], 12)[0]
    jobs = [
        GenerateJob([5, 17, 3, 9], 9, GREEDY),
        GenerateJob([8, 2], 14, GREEDY),
        GenerateJob([4, 9, 1], 12, Sampling(greedy=True), eod=free[5]),  # stops early on a token
        GenerateJob([30, 31], 6, Sampling(temperature=0.8, top_k=5, seed=3)),  # a sampled job: steps in sync
        GenerateJob([1, 2, 3, 4, 5, 6, 7, 8], 40, GREEDY),  # ends by the slot's length
        GenerateJob([9], 7, GREEDY, top_logprobs=2),
        GenerateJob([12, 13, 14], 8, GREEDY, stop_token_sequences=((free[2], free[3]),)),
    ]
    ahead, steps = _events(model, jobs, lookahead=True)
    in_step, none = _events(model, jobs, lookahead=False)
    assert steps > 0 and none == 0
    assert [[(e.token, e.finish_reason, e.top_logprobs is None) for e in job] for job in ahead] == \
        [[(e.token, e.finish_reason, e.top_logprobs is None) for e in job] for job in in_step]
    for job_a, job_s in zip(ahead, in_step):
        # (which prompts share a packed prefill depends on thread timing: fp32 rounding of the GEMMs differs)
        assert [e.logprob for e in job_a] == pytest.approx([e.logprob for e in job_s], abs=1e-4)
    assert [e.token for e in ahead[2]] == free[:6] and ahead[2][-1].finish_reason == "stop"
    assert ahead[4][-1].finish_reason == "length" and len(ahead[4]) == 40 - 8
    assert [e.token for e in ahead[0]] == generate(model, [[5, 17, 3, 9]], 9)[0]


def test_a_job_joining_or_cancelled_while_steps_run_ahead():
    model = make_model("llama")
    engine = GenerationEngine(model, EngineConfig(max_requests=3, max_sequence_length=64))
    events: list[list[TokenEvent]] = [[], [], []]
    done = [threading.Event() for _ in events]

    def listener(i: int):
        def on_event(event: TokenEvent) -> None:
            events[i].append(event)
            if event.finish_reason:
                done[i].set()
        return on_event

    try:
        first = engine.submit(GenerateJob([3, 1, 4], 50, GREEDY), listener(0))
        while len(events[0]) < 5:
            time.sleep(0.001)
        engine.submit(GenerateJob([2, 7], 10, GREEDY), listener(1))  # joins a running decode
        done[1].wait(30)
        first.cancel()
        done[0].wait(30)
        engine.submit(GenerateJob([6], 5, GREEDY), listener(2))  # the freed slots are reused
        done[2].wait(30)
    finally:
        engine.close()
    assert events[0][-1].finish_reason == "cancelled" and 5 <= len(events[0]) < 51
    assert [e.token for e in events[0][:-1]] == generate(model, [[3, 1, 4]], len(events[0]) - 1)[0]
    assert [e.token for e in events[1]] == generate(model, [[2, 7]], 10)[0]
    assert [e.token for e in events[2]] == generate(model, [[6]], 5)[0]
    assert engine.steps_ahead > 0
