"""The fixed-shape (graph-recordable) packed prefill against the eager prefill, on the CPU; recorded
as CUDA graphs inside the engine where CUDA is present."""

from __future__ import annotations

import pytest
import torch

from megatrain.inference.engine.prefill_graphs import StaticPrefill, accepts_logit_positions

from tests.unit.test_engine_slot_cache import make_model, make_runner

PACKS = [[(0, [5, 17, 3, 9, 22])], [(2, [8, 2]), (1, [30, 31, 32, 33, 34, 35, 36]), (3, [9])]]


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@torch.no_grad()
def test_static_prefill_equals_eager_prefill_logits_and_cache(style):
    model = make_model(style)
    eager, fixed = make_runner(model, max_len=16), make_runner(model, max_len=16)
    static = StaticPrefill(model, fixed.cache, torch.device("cpu"), max_tokens=24, record=False, buckets=(8, 16))
    for pack in PACKS:
        expected = eager.prefill(pack)
        got = static.run(pack)
        assert got.shape == expected.shape == (len(pack), model.config.vocab_size)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for n in eager.cache.keys:  # every real token's key/value at its slot and position
        for slot, prompt in [item for pack in PACKS for item in pack]:
            for table in ("keys", "values"):
                a = getattr(eager.cache, table)[n][slot, :, :len(prompt)]
                b = getattr(fixed.cache, table)[n][slot, :, :len(prompt)]
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert sorted(static._shapes) == [8, 16]  # the packs of 5 and 10 tokens, padded


@torch.no_grad()
def test_padding_writes_only_the_scratch_position_of_the_last_slot():
    model = make_model("llama")
    runner = make_runner(model, max_len=16)
    static = StaticPrefill(model, runner.cache, torch.device("cpu"), max_tokens=16, record=False, buckets=(8,))
    for table in (runner.cache.keys, runner.cache.values):
        for tensor in table.values():
            tensor.fill_(7.0)
    static.run([(1, [3, 4, 5])])  # 3 tokens padded to 8
    for table in (runner.cache.keys, runner.cache.values):
        for tensor in table.values():
            untouched = torch.ones_like(tensor, dtype=torch.bool)
            untouched[1, :, :3] = False
            untouched[1, :, 15] = False  # the scratch position (max_sequence_length - 1)
            assert bool((tensor[untouched] == 7.0).all())
            assert not bool((tensor[1, :, :3] == 7.0).any())


def test_which_packs_are_covered():
    model = make_model("gpt2")
    runner = make_runner(model, max_requests=4, max_len=16)
    static = StaticPrefill(model, runner.cache, torch.device("cpu"), max_tokens=100, record=False)
    assert static.token_buckets == (64, 100)
    assert static.covers([(0, [1] * 15)])  # padded to 64: the padding at position 15 of slot 0
    assert not static.covers([(1, [2] * 4), (0, [1] * 16)])  # ... which the last prompt stores
    assert static.covers([(0, [1] * 16), (1, [2] * 4)])  # (an earlier one may: its slot is not written)
    assert static.covers([(i, [1] * 16) for i in range(4)])  # 64 tokens, no padding
    assert not static.covers([])
    assert not static.covers([(i, [1] * 8) for i in range(5)])  # more prompts than slots
    assert not static.covers([(0, [1] * 101)])  # beyond the largest bucket
    with pytest.raises(ValueError, match="record"):
        StaticPrefill(model, runner.cache, torch.device("cpu"), max_tokens=64, record=True)
    assert accepts_logit_positions(model)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("style", ["gpt2", "llama"])
@torch.inference_mode()
def test_recorded_prefill_equals_eager_prefill_on_cuda(style):
    model = make_model(style).to("cuda")
    from megatrain.inference.engine.runner import ModelRunner
    from megatrain.inference.engine.slot_cache import CacheShape, SlotKVCache
    from megatrain.models.common.attention import SelfAttention

    layers = tuple(m.layer_number for m in model.modules() if isinstance(m, SelfAttention))
    shape = CacheShape(layers, model.config.num_query_groups, model.config.kv_channels, 4, 16)
    runners = [ModelRunner(model, SlotKVCache(shape, torch.float32, torch.device("cuda")), torch.device("cuda"),
                           cuda_graphs=True, prefill_graphs=graphs, prefill_tokens=24) for graphs in (False, True)]
    eager, graphed = runners
    for pack in PACKS * 2:  # the second time replays the recorded graphs
        torch.testing.assert_close(graphed.prefill(pack), eager.prefill(pack), rtol=1e-4, atol=1e-4)
    assert sorted(graphed.static_prefill._shapes) == [24]
    assert all(s.graph is not None for s in graphed.static_prefill._shapes.values())


@pytest.mark.gpu
@cuda
def test_engine_with_prefill_graphs_equals_without_on_cuda():
    from megatrain.inference.engine.api import GenerateJob, Sampling
    from megatrain.inference.engine.engine import EngineConfig, GenerationEngine, generate_blocking

    model = make_model("llama").to("cuda")
    prompts = [[5, 17, 3, 9, 22, 40, 1], [8, 2], [30, 31, 32, 33], [9], list(range(1, 30))]
    results = []
    for graphs in (False, True):
        engine = GenerationEngine(model, EngineConfig(max_requests=3, max_sequence_length=48, length_bucket=8,
                                                      prefill_graphs=graphs, prefill_tokens=64))
        try:
            assert (engine.runner.static_prefill is not None) == graphs
            events = generate_blocking(engine, [GenerateJob(p, 12, Sampling(greedy=True)) for p in prompts])
        finally:
            engine.close()
        results.append([[e.token for e in job] for job in events])
    assert results[0] == results[1]


@torch.no_grad()
def test_a_prefill_graph_that_cannot_be_recorded_falls_back_to_eager_prefills(caplog):
    """A model whose forward cannot be recorded (here: the recording itself refuses) leaves the runner
    prefilling eagerly, with the eager logits, after one warning."""
    from megatrain.inference.engine.prefill_graphs import GraphRecordError

    class Unrecordable(StaticPrefill):
        def run(self, items):
            raise GraphRecordError("recording the prefill graph of 8 tokens failed: RuntimeError: a sync")

    model = make_model("llama")
    eager, runner = make_runner(model, max_len=16), make_runner(model, max_len=16)
    runner.static_prefill = Unrecordable(model, runner.cache, torch.device("cpu"), max_tokens=16, record=False)
    pack = PACKS[1]
    with caplog.at_level("WARNING"):
        got = runner.prefill(pack)
    torch.testing.assert_close(got, eager.prefill(pack), rtol=1e-5, atol=1e-5)
    assert runner.static_prefill is None and "prefills run eagerly" in caplog.text


@torch.no_grad()
def test_a_decode_graph_that_cannot_be_recorded_falls_back_to_eager_decode(caplog):
    """The same for the decode graphs: the step that could not be recorded, and every later one, runs
    eagerly with the eager logits (a model that reads a count on the host inside its forward)."""
    from megatrain.inference.engine.runner import ModelRunner

    class Unrecordable(ModelRunner):
        def _record(self, batch, key_length):
            raise RuntimeError("operation not permitted when stream is capturing")

    model = make_model("llama")
    eager = make_runner(model, max_len=16)
    runner = Unrecordable(model, eager.cache.__class__(eager.cache.shape, torch.float32, torch.device("cpu")),
                          torch.device("cpu"), cuda_graphs=False)
    runner.cuda_graphs = True  # as on CUDA; the recording is what fails
    for r in (eager, runner):
        r.prefill([(0, [5, 17, 3]), (1, [8, 2])])
    with caplog.at_level("WARNING"):
        got = runner.decode([4, 9], [3, 2], 4)
    torch.testing.assert_close(got, eager.decode([4, 9], [3, 2], 4), rtol=1e-5, atol=1e-5)
    assert not runner.cuda_graphs and "decode steps run eagerly" in caplog.text
    assert runner.decode([1, 1], [4, 3], 5).shape == (2, model.config.vocab_size)  # eager from now on
