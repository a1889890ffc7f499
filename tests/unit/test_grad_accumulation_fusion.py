"""Gradient-accumulation fusion: linear layers on a half-precision weight copy whose weight-gradient
matmul adds into the gradient accumulated so far (float32)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel
from megatrain.runtime.grad_accumulation_fusion import FusedGradLinear, GradAccumulationFusion, convert_linears
from megatrain.parallel.dims import ParallelDims
from megatrain.parallel.parallelize import Parallelized, ParallelizeConfig, parallelize_model
from megatrain.parallel.recompute import RecomputeConfig

GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=96, max_position_embeddings=16,
           ffn_hidden_size=64, hidden_dropout=0.0, attention_dropout=0.0)


def _pair(bias: bool, dtype: torch.dtype) -> tuple[nn.Sequential, nn.Sequential, GradAccumulationFusion]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(24, 40, bias=bias), nn.GELU(), nn.Linear(40, 16, bias=bias))
    fused = copy.deepcopy(ref)
    linears = convert_linears(fused.modules())
    assert [type(m) for m in fused] == [FusedGradLinear, nn.GELU, FusedGradLinear]
    return ref, fused, GradAccumulationFusion(linears, dtype)


def _accumulate(model: nn.Module, xs: list[torch.Tensor], fusion: GradAccumulationFusion | None,
                compiled: bool = False) -> None:
    run = torch.compile(model) if compiled else model
    if fusion is not None:
        fusion.refresh()
    for x in xs:
        if fusion is not None:
            fusion.stage()
        loss = run(x).square().sum()
        if fusion is not None:
            fusion.release()
        loss.backward()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("compiled", [False, True])
def test_float32_copy_gives_the_plain_layers_gradients(bias, compiled):
    """With a float32 'half' copy the maths is nn.Linear's: same outputs and accumulated gradients."""
    ref, fused, fusion = _pair(bias, torch.float32)
    xs = [torch.randn(3, 5, 24) for _ in range(3)]
    for step in range(2):  # the second step's first micro-batch starts from zero again
        for m in (ref, fused):
            m.zero_grad(set_to_none=True)
        _accumulate(ref, xs, None)
        _accumulate(fused, xs, fusion, compiled)
        for (name, a), b in zip(fused.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6 * b.grad.abs().max().item(),
                                       msg=f"step {step}: {name}")
            assert a.grad.dtype == torch.float32
        with torch.no_grad():  # an optimizer step: the copies must follow
            for p in list(ref.parameters()) + list(fused.parameters()):
                p.sub_(0.01 * p.grad)


def test_bf16_copy_accumulates_in_float32_without_rounding_each_micro_batch():
    """Forward equals autocast's bf16 linear; the weight gradient is the float32 sum of the
    micro-batches' bf16 products (no bf16 rounding of each contribution)."""
    ref, fused, fusion = _pair(True, torch.bfloat16)
    xs = [torch.randn(4, 24) for _ in range(4)]
    fusion.refresh()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(fused(xs[0]), ref(xs[0]), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _accumulate(fused, xs, fusion)
    lin = fused[0]
    # expected weight gradient of the first layer: sum over micro-batches of dY^T X from bf16 operands
    expected = torch.zeros_like(lin.weight)
    for x in xs:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.nn.functional.linear(x, lin.weight.to(torch.bfloat16), lin.bias.to(torch.bfloat16))
            h.requires_grad_(True)
            y = fused[2](fused[1](h))
        (g,) = torch.autograd.grad(y.float().square().sum(), h)
        expected += g.to(torch.bfloat16).float().t() @ x.to(torch.bfloat16).float()
    torch.testing.assert_close(lin.weight.grad, expected, rtol=1e-5, atol=1e-5)
    assert lin.weight.grad.dtype == torch.float32 and lin.half_weight.dtype == torch.bfloat16


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_without_staging_autograd_adds_the_gradients(compiled):
    """Layers called outside the protocol (a plain backward) still get correct gradients."""
    ref, fused, fusion = _pair(True, torch.float32)
    run = torch.compile(fused) if compiled else fused
    fusion.refresh()
    xs = [torch.randn(2, 24) for _ in range(2)]
    _accumulate(ref, xs, None)
    for x in xs:
        run(x).square().sum().backward()
    for a, b in zip(fused.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_release_drops_the_staged_gradients():
    _, fused, fusion = _pair(False, torch.float32)
    fusion.refresh()
    fusion.stage()
    assert all(m.main_grad_in is not None and m.weight.grad is None for m in fusion.linears)
    fusion.release()
    assert all(m.main_grad_in is None for m in fusion.linears)
    fusion.drop_half_weights()
    assert all(m.half_weight is None for m in fusion.linears)


def _parallelized(**cfg) -> Parallelized:
    with torch.device("meta"):
        model = GPTModel(GPTConfig(**GPT))
    return parallelize_model(model, ParallelDims(world_size=1), ParallelizeConfig(**cfg), device=torch.device("cpu"),
                             seed=1)


def test_parallelize_applies_it_for_half_precision_only():
    assert _parallelized().grad_fusion is None  # float32 compute
    made = _parallelized(compute_dtype=torch.bfloat16)
    model, fusion = made.module, made.grad_fusion
    assert len(fusion.linears) == 4 * GPT["num_layers"] and fusion.dtype == torch.bfloat16
    assert type(model.output_layer if hasattr(model, "output_layer") else model.embedding.word_embeddings) \
        is not FusedGradLinear
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in _parallelized().module.named_parameters()]
    assert "half_weight" not in str(list(model.state_dict()))
    assert _parallelized(compute_dtype=torch.bfloat16, grad_accumulation_fusion=False).grad_fusion is None
    assert _parallelized(compute_dtype=torch.bfloat16, recompute=RecomputeConfig("full")).grad_fusion is None
    assert _parallelized(compute_dtype=torch.bfloat16, recompute=RecomputeConfig("selective")).grad_fusion is not None


@pytest.mark.parametrize("untie, rows", [(False, False), (False, True), (True, True)],
                         ids=["tied", "tied_rows", "untied"])
@pytest.mark.parametrize("fresh", [False, True])
def test_chunked_loss_output_weight_joins_the_fusion(untie, rows, fresh):
    """The output weight's matmuls in the chunked loss follow the protocol too (a tied weight also
    gets the embedding's gradient: ``rows``, the embedding adds its rows into the staged buffer
    (megatrain.runtime.embedding_grad_fusion), else autograd adds its dense gradient): equal to the
    plain model with float32 copies. ``fresh``: one micro-batch staged with nothing (the matmuls write
    the gradients; the loss's chunks add theirs to the first chunk's), the tied weight's buffer
    excepted where the embedding adds into it."""
    from megatrain.runtime.embedding_grad_fusion import FusedGradEmbedding, convert_tied_embeddings

    fields = dict(GPT, untie_embeddings_and_output_weights=untie)
    torch.manual_seed(0)
    ref = GPTModel(GPTConfig(**fields))
    fused = copy.deepcopy(ref)
    from megatrain.runtime.fused_loss import ChunkedCrossEntropy
    for m in (ref, fused):
        m.loss_head = ChunkedCrossEntropy(8)
    linears = convert_linears(m for layer in fused.layers.values() for m in layer.modules())
    embeddings = convert_tied_embeddings(fused, fused.output_weight()) if rows else []
    assert len(embeddings) == (1 if rows and not untie else 0)
    assert (type(fused.embedding.word_embeddings) is FusedGradEmbedding) == bool(embeddings)
    fusion = GradAccumulationFusion(linears, torch.float32, [(fused.loss_head, fused.output_weight())],
                                    embeddings=embeddings)
    tokens = [torch.randint(0, 96, (2, 16)) for _ in range(1 if fresh else 3)]
    for step in range(2):
        for m in (ref, fused):
            m.zero_grad(set_to_none=True)
        fusion.refresh()
        for t in tokens:
            ref(t, labels=t.roll(-1, 1)).mean().backward()
            fusion.stage(fresh=fresh)
            loss = fused(t, labels=t.roll(-1, 1)).mean()
            fusion.release()
            loss.backward()
        for (name, a), b in zip(fused.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6 * b.grad.abs().max().item(),
                                       msg=f"step {step}: {name}")
        with torch.no_grad():
            for p in list(ref.parameters()) + list(fused.parameters()):
                p.sub_(0.01 * p.grad)
    assert fused.loss_head.half_weight is not None and fused.loss_head.main_grad_in is None
    assert all(e.main_grad_in is None for e in embeddings)


def test_parallelize_includes_the_chunked_loss_output_weight():
    from megatrain.runtime.embedding_grad_fusion import FusedGradEmbedding

    made = _parallelized(compute_dtype=torch.bfloat16, cross_entropy_chunk_size=16)
    holders = [h for h, _ in made.grad_fusion.slots]
    assert holders[-1] is made.loss_head is made.module.loss_head and len(holders) == 4 * GPT["num_layers"] + 1
    assert made.grad_fusion.slots[-1][1] is made.module.embedding.word_embeddings.weight
    # the tied word embedding adds its rows into the output weight's staged gradient
    assert type(made.module.embedding.word_embeddings) is FusedGradEmbedding
    assert "main_grad_in" not in str(list(made.module.state_dict()))
    made.grad_fusion.detach_embeddings()  # CUDA-graph recording: autograd's dense gradient again
    made.grad_fusion.stage(fresh=True)
    assert made.module.embedding.word_embeddings.main_grad_in is None
    made.grad_fusion.release()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_staged_gradient_is_updated_in_place_and_becomes_the_new_grad(compiled):
    """No copy: the matmul adds into the staged tensor and autograd keeps that tensor as ``.grad``."""
    _, fused, fusion = _pair(True, torch.float32)
    run = torch.compile(fused) if compiled else fused
    fusion.refresh()
    for _ in range(3):
        fusion.stage()
        staged = [m.main_grad_in.data_ptr() for m in fusion.linears]
        loss = run(torch.randn(4, 24)).square().sum()
        fusion.release()
        loss.backward()
        assert [m.weight.grad.data_ptr() for m in fusion.linears] == staged


def test_where_the_fusion_applies():
    """Only on plain weights: not with FSDP2, TP (DTensor weights), PP or full recomputation; with fp8
    unless torchao's layers are asked for (MEGATRAIN_FP8_BACKEND=torchao: fp8_fused False)."""
    from megatrain.parallel.parallelize import grad_accumulation_fusion_applies as applies

    half = ParallelizeConfig(compute_dtype=torch.bfloat16)
    assert applies(half, ParallelDims(world_size=1), fsdp=False)
    assert applies(half, ParallelDims(world_size=4, cp=2), fsdp=False)  # CP x DDP
    assert not applies(half, ParallelDims(world_size=2), fsdp=True)
    assert not applies(half, ParallelDims(world_size=2, tp=2), fsdp=False)
    assert not applies(half, ParallelDims(world_size=2, pp=2), fsdp=False)
    assert applies(ParallelizeConfig(compute_dtype=torch.bfloat16, fp8_format="hybrid"), ParallelDims(world_size=1),
                   fsdp=False)
    assert not applies(ParallelizeConfig(compute_dtype=torch.bfloat16, fp8_format="hybrid", fp8_fused=False),
                       ParallelDims(world_size=1), fsdp=False)
    assert not applies(ParallelizeConfig(), ParallelDims(world_size=1), fsdp=False)  # float32 compute
    assert applies(ParallelizeConfig(grad_accumulation_fusion=True), ParallelDims(world_size=1), fsdp=False)


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_held_gradients_of_the_other_parameters_sum_like_autograd(untie):
    """Norms, biases and embeddings: held aside during a micro-batch's backward and added back by
    one multi-tensor addition, their gradients equal autograd's per-parameter additions exactly."""
    from megatrain.runtime.fused_loss import ChunkedCrossEntropy
    torch.manual_seed(0)
    models = [GPTModel(GPTConfig(**dict(GPT, untie_embeddings_and_output_weights=untie)))]
    models.append(copy.deepcopy(models[0]))
    fusions = []
    for m in models:
        m.loss_head = ChunkedCrossEntropy(8)
        linears = convert_linears(x for layer in m.layers.values() for x in layer.modules())
        fusions.append(GradAccumulationFusion(linears, torch.float32, [(m.loss_head, m.output_weight())],
                                              others=m.parameters()))
    assert fusions[0].others and all(p.requires_grad for p in fusions[0].others)
    assert not {id(p) for p in fusions[0].others} & {id(w) for _, w in fusions[0].slots}
    tokens = [torch.randint(0, 96, (2, 16)) for _ in range(3)]
    for hold, m, fusion in zip((False, True), models, fusions):
        fusion.refresh()
        for t in tokens:
            fusion.stage(hold_others=hold)
            if hold and t is not tokens[0]:  # after the first micro-batch every other gradient is held
                assert all(p.grad is None for p in fusion.others)
            loss = m(t, labels=t.roll(-1, 1)).mean()
            fusion.release()
            loss.backward()
            fusion.merge_held()
    for (name, a), b in zip(models[1].named_parameters(), models[0].parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_each_step_starts_from_zeros_and_the_staged_gradient_becomes_grad():
    """After ``zero_grad(set_to_none=True)`` the first micro-batch's gradients start from zeros again
    and become ``.grad`` without a copy; each step's gradients are those of a fresh accumulation."""
    ref, fused, fusion = _pair(True, torch.float32)
    torch.manual_seed(1)
    steps = [[torch.randn(4, 24) for _ in range(2)] for _ in range(3)]
    for xs in steps:
        for m in (ref, fused):
            m.zero_grad(set_to_none=True)
        _accumulate(ref, xs, None)
        fusion.refresh()
        for x in xs:
            fusion.stage()
            staged = [m.main_grad_in.data_ptr() for m in fusion.linears]
            loss = fused(x).square().sum()
            fusion.release()
            loss.backward()
            assert [m.weight.grad.data_ptr() for m in fusion.linears] == staged
        for a, b in zip(ref.parameters(), fused.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-5)
        assert all(m.main_grad_in is None for m in fusion.linears)
    fusion.drop_half_weights()
    assert all(m.half_weight is None for m in fusion.linears)
    fused.zero_grad(set_to_none=True)
    _accumulate(fused, steps[0], fusion)  # the copies come back with the next refresh
    assert all(m.weight.grad is not None for m in fusion.linears)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_first_micro_batch_writes_its_products_into_unfilled_buffers(compiled):
    """A step's first micro-batch stages buffers without values (no zero-filling pass): the matmuls write
    into them, later micro-batches add. NaN in the staged buffers before the first backward must not
    reach the gradients (the old contents are never read), eager and inside compiled code."""
    from megatrain.runtime import grad_accumulation_fusion as gaf

    ref, fused, fusion = _pair(True, torch.float32)
    torch.manual_seed(2)
    xs = [torch.randn(4, 24) for _ in range(3)]
    _accumulate(ref, xs, None)
    run = torch.compile(fused) if compiled else fused
    fusion.refresh()
    for i, x in enumerate(xs):
        fusion.stage()
        if i == 0:
            assert len(gaf._UNWRITTEN) == len(fusion.linears)
            for m in fusion.linears:
                m.main_grad_in.fill_(float("nan"))  # in place: the same buffers, still unwritten
        else:
            assert not gaf._UNWRITTEN
        loss = run(x).square().sum()
        fusion.release()
        loss.backward()
        fusion.merge_held()
        assert not gaf._UNWRITTEN
    for a, b in zip(ref.parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-5)


def test_a_weight_with_a_gradient_keeps_it_when_others_start_from_zeros():
    """Mixed: one weight's gradient set, another's None; the set one is accumulated into, not reset."""
    _, fused, fusion = _pair(False, torch.float32)
    _accumulate(fused, [torch.randn(4, 24)], fusion)
    kept = fusion.linears[0].weight.grad.clone()
    fusion.linears[1].weight.grad = None
    fusion.stage()
    assert torch.equal(fusion.linears[0].main_grad_in, kept)
    assert torch.count_nonzero(fusion.linears[1].main_grad_in) == 0
    assert all(m.weight.grad is None for m in fusion.linears)
    fusion.release()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("compiled", [False, True])
def test_a_single_micro_batch_writes_fresh_gradients(bias, compiled):
    """``stage(fresh=True)`` (the step's only micro-batch) stages nothing: the weight-gradient matmuls
    write new float32 gradients, equal to the plain layers' and to the zero-staged path's, step after
    step, eager and compiled."""
    ref, fused, fusion = _pair(bias, torch.float32)
    _, staged, staged_fusion = _pair(bias, torch.float32)
    run = torch.compile(fused) if compiled else fused
    for step in range(3):
        x = torch.randn(3, 5, 24)
        for m in (ref, fused, staged):
            m.zero_grad(set_to_none=True)
        ref(x).square().sum().backward()
        _accumulate(staged, [x], staged_fusion)
        fusion.refresh()
        fusion.stage(fresh=True)
        assert all(m.main_grad_in is None for m in fusion.linears)
        loss = run(x).square().sum()
        fusion.release()
        loss.backward()
        for (name, a), b, c in zip(fused.named_parameters(), ref.parameters(), staged.parameters()):
            assert a.grad.dtype == torch.float32
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6 * b.grad.abs().max().item(),
                                       msg=f"step {step}: {name}")
            torch.testing.assert_close(a.grad, c.grad, rtol=1e-5 if compiled else 1e-6,
                                       atol=1e-6 * c.grad.abs().max().item() if compiled else 0,
                                       msg=f"step {step}: {name}")
        with torch.no_grad():
            for m in (ref, fused, staged):
                for p in m.parameters():
                    p.sub_(0.01 * p.grad)


def test_fresh_staging_refuses_gradients_left_from_before():
    _, fused, fusion = _pair(False, torch.float32)
    fusion.refresh()
    fused(torch.randn(2, 24)).sum().backward()
    with pytest.raises(AssertionError, match="must start empty"):
        fusion.stage(fresh=True)
