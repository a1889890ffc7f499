"""The generation engine (continuous batching over the slot cache) against `generate` and the api contract."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from megatrain.inference.engine import sampler as sampler_module
from megatrain.inference.engine.api import EngineFull, GenerateJob, Sampling, TokenEvent
from megatrain.inference.engine.engine import EngineConfig, GenerationEngine, generate_blocking
from megatrain.inference.engine.plan import StepPlan
from megatrain.inference.engine.sampler import JobSampler
from megatrain.inference.generation import generate

from tests.unit.test_engine_slot_cache import VOCAB, make_model

PROMPTS = [[5, 17, 3, 9, 22, 40, 1], [8, 2], [30, 31, 32, 33], [9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
GREEDY = Sampling(greedy=True)


@pytest.fixture(params=["gpt2", "llama"])
def model(request):
    return make_model(request.param)


def run_engine(model, jobs, **config):
    engine = GenerationEngine(model, EngineConfig(**{"max_requests": 2, "max_sequence_length": 40, **config}))
    try:
        return generate_blocking(engine, jobs)
    finally:
        engine.close()


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [e.token for e in events if e.finish_reason not in ("error", "cancelled")]


def test_greedy_equals_generate_with_jobs_joining_at_different_times(model):
    expected = [generate(model, [p], 9)[0] for p in PROMPTS]
    engine = GenerationEngine(model, EngineConfig(max_requests=3, max_sequence_length=40))
    events: list[list[TokenEvent]] = [[] for _ in PROMPTS]
    done = [threading.Event() for _ in PROMPTS]

    def submit(i: int) -> None:
        def on_event(event: TokenEvent) -> None:
            events[i].append(event)
            if event.finish_reason:
                done[i].set()
        engine.submit(GenerateJob(PROMPTS[i], 9, GREEDY), on_event)

    try:
        submit(0)
        while len(events[0]) < 3:  # the others join a running decode
            time.sleep(0.001)
        submit(1)
        submit(2)
        while len(events[1]) < 2:
            time.sleep(0.001)
        submit(3)
        submit(4)  # waits for a slot: 3 slots, 5 jobs
        for flag in done:
            assert flag.wait(60)
    finally:
        engine.close()
    assert [tokens_of(e) for e in events] == expected
    assert all(e[-1].finish_reason == "length" and all(x.finish_reason is None for x in e[:-1]) for e in events)


@pytest.mark.parametrize("prefill_tokens", [1, 8, 2048])  # alone, packs split by the budget, one pack
def test_prompts_admitted_together_equal_generate(model, prefill_tokens):
    events = run_engine(model, [GenerateJob(p, 6, GREEDY) for p in PROMPTS], max_requests=5,
                        prefill_tokens=prefill_tokens)
    assert [tokens_of(e) for e in events] == [generate(model, [p], 6)[0] for p in PROMPTS]


def test_logprobs_are_the_raw_models(model):
    (events,) = run_engine(model, [GenerateJob(PROMPTS[0], 4, Sampling(temperature=0.7, seed=3), top_logprobs=3)])
    sequence = list(PROMPTS[0])
    with torch.no_grad():
        for event in events:
            logprobs = torch.log_softmax(model(torch.tensor([sequence]))[0, -1].float(), dim=-1)
            assert event.logprob == pytest.approx(logprobs[event.token].item(), abs=1e-5)
            top = torch.topk(logprobs, 3)
            assert [t for t, _ in event.top_logprobs] == top.indices.tolist()
            assert [v for _, v in event.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
            sequence.append(event.token)


def test_seeded_sampling_does_not_depend_on_other_jobs(model):
    job = GenerateJob(PROMPTS[2], 12, Sampling(temperature=1.5, top_k=20, top_p=0.9, seed=1234))
    (alone,) = run_engine(model, [job])
    others = [GenerateJob(p, 10, Sampling(temperature=1.0, seed=i)) for i, p in enumerate(PROMPTS)]
    crowded = run_engine(model, others[:2] + [job] + others[2:], max_requests=4)
    assert tokens_of(crowded[2]) == tokens_of(alone)
    assert len(set(tuple(tokens_of(e)) for e in crowded)) > 1  # the jobs really sampled
    (again,) = run_engine(model, [job])
    assert tokens_of(again) == tokens_of(alone)


def test_stop_rules(model):
    (free,) = run_engine(model, [GenerateJob(PROMPTS[0], 8, GREEDY)])
    out = tokens_of(free)
    eod = out[3]
    first = out.index(eod)
    (eod_run,) = run_engine(model, [GenerateJob(PROMPTS[0], 8, GREEDY, eod=eod)])
    assert tokens_of(eod_run) == out[:first + 1] and eod_run[-1].finish_reason == "stop"
    stop = out[4:6]
    (stop_run,) = run_engine(model, [GenerateJob(PROMPTS[0], 8, GREEDY, stop_token_sequences=[[99], stop])])
    ends = next(i + 2 for i in range(len(out) - 1) if out[i:i + 2] == stop)
    assert tokens_of(stop_run) == out[:ends] and stop_run[-1].finish_reason == "stop"
    # the slot's limit: 7 prompt tokens + 5 new ones fill max_sequence_length 12
    (limited,) = run_engine(model, [GenerateJob(PROMPTS[0], 30, GREEDY)], max_sequence_length=12)
    assert tokens_of(limited) == generate(model, [PROMPTS[0]], 5)[0] and limited[-1].finish_reason == "length"


def test_logit_bias_and_penalties(model):
    (biased,) = run_engine(model, [GenerateJob(PROMPTS[1], 5, Sampling(greedy=True, logit_bias={7: 100.0}))])
    assert tokens_of(biased) == [7] * 5
    (penalised,) = run_engine(model, [GenerateJob(PROMPTS[1], 12, Sampling(greedy=True, presence_penalty=1000.0))])
    assert len(set(tokens_of(penalised))) == 12


def test_top_p_decay_follows_megatron():
    s = JobSampler(Sampling(top_p=0.9, top_p_decay=0.5, top_p_bound=0.3), torch.device("cpu"))
    s.observe(1)
    assert s.top_p == pytest.approx(0.45)
    s.observe(1)
    assert s.top_p == pytest.approx(0.3)
    assert s.counts == {1: 2}


def test_cancel_and_close(model):
    engine = GenerationEngine(model, EngineConfig(max_requests=1, max_sequence_length=40))
    events: dict[str, list[TokenEvent]] = {"a": [], "b": [], "c": []}
    handles = {k: engine.submit(GenerateJob(PROMPTS[0], 30, Sampling(temperature=1.0, seed=1)), events[k].append)
               for k in events}
    while len(events["a"]) < 2:
        time.sleep(0.001)
    handles["a"].cancel()
    handles["b"].cancel()  # still waiting for the slot
    while not events["c"]:
        time.sleep(0.001)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(GenerateJob(PROMPTS[0], 3), lambda e: None)
    assert events["a"][-1].finish_reason == "cancelled" and events["a"][-1].token == -1
    assert [e.finish_reason for e in events["b"]] == ["cancelled"]
    assert events["c"][-1].finish_reason in ("cancelled", "length")


def test_engine_full_and_bad_jobs(model):
    engine = GenerationEngine(model, EngineConfig(max_requests=1, max_sequence_length=16, max_waiting=1))
    gate = threading.Event()
    try:
        engine.register("hold", lambda m, payload: gate.wait(30))
        held = engine.call("hold", {})  # the engine thread waits inside it: nothing is admitted meanwhile
        engine.submit(GenerateJob([1], 2), lambda e: None)  # takes the free slot
        engine.submit(GenerateJob([1], 2), lambda e: None)  # waits
        with pytest.raises(EngineFull) as full:
            engine.submit(GenerateJob([1], 2), lambda e: None)
        assert full.value.retry_after_s == 1
        for bad, match in [(GenerateJob([], 2), "at least one token"), (GenerateJob([VOCAB], 2), "token id"),
                           (GenerateJob([1] * 16, 2), "max_sequence_length"), (GenerateJob([1], 0), "max_new_tokens"),
                           (GenerateJob([1], 2, Sampling(temperature=0.0)), "temperature"),
                           (GenerateJob([1], 2, Sampling(greedy=True, top_k=3)), "greedy"),
                           (GenerateJob([1], 2, Sampling(logit_bias={VOCAB: 1.0})), "logit_bias")]:
            with pytest.raises(ValueError, match=match):
                engine.submit(bad, lambda e: None)
        gate.set()
        assert held.result(30) is True
    finally:
        gate.set()
        engine.close()


def test_one_jobs_errors_do_not_stop_the_others(model, monkeypatch):
    choose = JobSampler.choose

    def failing(self, logits):
        if self.sampling.temperature == 0.5:
            raise RuntimeError("boom")
        return choose(self, logits)

    monkeypatch.setattr(sampler_module.JobSampler, "choose", failing)

    def bad_callback(event):
        raise RuntimeError("client went away")

    engine = GenerationEngine(model, EngineConfig(max_requests=4, max_sequence_length=40))
    try:
        engine.submit(GenerateJob(PROMPTS[1], 5, GREEDY), bad_callback)
        failed, ok = generate_blocking(engine, [GenerateJob(PROMPTS[0], 5, Sampling(temperature=0.5)),
                                                GenerateJob(PROMPTS[2], 5, GREEDY)])
    finally:
        engine.close()
    assert [e.finish_reason for e in failed] == ["error"] and "boom" in failed[0].error
    assert tokens_of(ok) == generate(model, [PROMPTS[2]], 5)[0]


def test_register_and_call(model):
    engine = GenerationEngine(model, EngineConfig(max_requests=2, max_sequence_length=40))
    try:
        def score(m, payload):
            with torch.no_grad():
                logits = m(torch.tensor([payload["ids"]]))
            return float(torch.log_softmax(logits[0, -1].float(), -1)[payload["next"]])

        engine.register("score", score)
        engine.register("fail", lambda m, payload: 1 / 0)
        future = engine.call("score", {"ids": PROMPTS[0], "next": 3})
        expected = torch.log_softmax(model(torch.tensor([PROMPTS[0]]))[0, -1].float(), -1)[3].item()
        assert future.result(30) == pytest.approx(expected, abs=1e-6)
        with pytest.raises(ZeroDivisionError):
            engine.call("fail", {}).result(30)
        with pytest.raises(ValueError, match="no function"):
            engine.call("missing", {})
        with pytest.raises(ValueError, match="plain JSON"):
            engine.call("score", {"ids": object()})
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.call("score", {})


def test_plan_round_trips_as_json():
    plan = StepPlan(calls=[("score", {"ids": [1, 2]})], decode_tokens=[3, 0], decode_positions=[5, 39],
                    decode_keys=6, prefills=[(1, [4, 5, 6])])
    data = plan.to_json()
    json.loads(data)  # plain JSON, no pickle
    assert StepPlan.from_json(data) == plan


def test_refuses_encoder_decoder_and_too_long_caches():
    with pytest.raises(ValueError, match="max-position-embeddings"):
        GenerationEngine(make_model("gpt2"), EngineConfig(max_sequence_length=65))


def test_mixture_of_experts_and_window_models_equal_generate():
    for overrides in (dict(num_moe_experts=4, moe_router_topk=2), dict(window_size=(3, 0))):
        model = make_model("llama", **overrides)
        events = run_engine(model, [GenerateJob(p, 6, GREEDY) for p in PROMPTS], max_requests=3)
        assert [tokens_of(e) for e in events] == [generate(model, [p], 6)[0] for p in PROMPTS], overrides


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_graphs_greedy_choice_is_the_samplers(dtype):
    from megatrain.inference.engine.runner import greedy_choice

    torch.manual_seed(0)
    logits = (torch.randn(5, 1000) * 4).to(dtype)
    choice = greedy_choice(logits)
    expected = sampler_module.sample_rows(logits, [JobSampler(Sampling(greedy=True), logits.device)
                                                   for _ in range(5)], [0] * 5)
    assert choice.dtype == torch.float64 and choice.shape == (2, 5)
    assert [int(t) for t in choice[0]] == [c.token for c in expected]
    assert choice[1].tolist() == pytest.approx([c.logprob for c in expected], rel=1e-6, abs=1e-6)
