"""The chunked output-layer cross entropy computes the plain head's loss and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatrain.models.gpt.config import GPTConfig
from megatrain.runtime.fused_loss import ChunkedCrossEntropy, chunked_cross_entropy
from megatrain.models.gpt import GPTModel


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 21, 1000])
def test_matches_cross_entropy_of_the_logits_in_float64(chunk_size):
    torch.manual_seed(0)
    h = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (3, 7))
    y[0, 2] = y[2, 6] = -100  # ignored: loss 0 and no gradient
    g = torch.randn(3, 7, dtype=torch.float64)  # an arbitrary upstream gradient per token
    ref = F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten(), reduction="none").view(3, 7)
    ref_gh, ref_gw = torch.autograd.grad((ref * g).sum(), (h, w))
    out = chunked_cross_entropy(h, w, y, chunk_size)
    gh, gw = torch.autograd.grad((out * g).sum(), (h, w))
    assert out.shape == (3, 7) and out[0, 2] == 0 and out[2, 6] == 0
    assert _rel(out, ref) < 1e-12 and _rel(gh, ref_gh) < 1e-12 and _rel(gw, ref_gw) < 1e-12


@pytest.mark.parametrize("ignored", [0.0, 0.5, 0.95, 1.0])
def test_labeled_rows_only_is_the_same_maths(ignored):
    """The output layer and loss on the labeled rows alone (gathered, scattered back): the same loss and
    gradients as every row, with or without the bias and the fused weight gradient; nearly every row
    labeled (above the gathering threshold) and no row labeled both work."""
    torch.manual_seed(2)
    h = torch.randn(4, 25, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (4, 25))
    y[torch.rand(4, 25) < ignored] = -100
    g = torch.randn(4, 25, dtype=torch.float64)
    for kw in ({}, {"bias": bias}, {"half_weight": w.detach(), "prev_grad": torch.randn(50, 16, dtype=torch.float64)}):
        ref = chunked_cross_entropy(h, w, y, 7, **kw)
        ref_grads = torch.autograd.grad((ref * g).sum(), (h, w, bias) if "bias" in kw else (h,) if "half_weight" in kw
                                        else (h, w))
        out = chunked_cross_entropy(h, w, y, 7, labeled_rows_only=True, **kw)
        grads = torch.autograd.grad((out * g).sum(), (h, w, bias) if "bias" in kw else (h,) if "half_weight" in kw
                                    else (h, w))
        assert out.shape == (4, 25) and bool((out[y == -100] == 0).all())
        assert _rel(out, ref) < 1e-12 if ignored < 1.0 else bool((out == 0).all())
        for a, b in zip(grads, ref_grads):
            assert _rel(a, b) < 1e-12, (kw.keys(), _rel(a, b))


def test_the_llava_and_sft_objectives_ask_for_labeled_rows_only():
    from megatrain.models.gpt.objective import CausalLMObjective
    from megatrain.models.llava.objective import LlavaObjective
    from megatrain.training.finetune import SFTObjective
    from megatrain.training.trainer import ChunkedCrossEntropy as Head

    assert LlavaObjective.sparse_labels and SFTObjective.sparse_labels and Head is ChunkedCrossEntropy
    assert not CausalLMObjective.sparse_labels  # pre-training labels every row: no synchronisation


def _tiny(untied: bool, **kw) -> GPTConfig:
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=96, max_position_embeddings=32,
                     hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=untied, **kw)


def _loss_and_grads(model: GPTModel, tokens, labels, mask) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    per_token = model(tokens, labels=labels)
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_model_loss_and_gradients_equal_the_plain_head_in_fp32(untied):
    torch.manual_seed(1)
    model = GPTModel(_tiny(untied))
    tokens = torch.randint(0, 96, (3, 20))
    labels = torch.randint(0, 96, (3, 20))
    labels[1, :5] = -100
    mask = (torch.rand(3, 20) > 0.3).float()
    plain_loss, plain_grads = _loss_and_grads(model, tokens, labels, mask)
    model.loss_head = ChunkedCrossEntropy(chunk_size=16)
    loss, grads = _loss_and_grads(model, tokens, labels, mask)
    assert abs(loss.item() - plain_loss.item()) <= 1e-6 * abs(plain_loss.item())
    for name in plain_grads:
        assert _rel(grads[name], plain_grads[name]) < 1e-6, name
    # Without labels the model still returns the logits.
    assert model(tokens).shape == (3, 20, 96)


def test_bf16_autocast_matches_the_plain_head_within_bf16_tolerance():
    torch.manual_seed(2)
    model = GPTModel(_tiny(untied=True))
    tokens, labels = torch.randint(0, 96, (2, 24)), torch.randint(0, 96, (2, 24))
    mask = torch.ones(2, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_loss, plain_grads = _loss_and_grads(model, tokens, labels, mask)
        model.loss_head = ChunkedCrossEntropy(chunk_size=10)
        loss, grads = _loss_and_grads(model, tokens, labels, mask)
    assert abs(loss.item() - plain_loss.item()) < 1e-2 * abs(plain_loss.item())
    for name in plain_grads:
        assert grads[name].dtype == torch.float32
        assert _rel(grads[name], plain_grads[name]) < 3e-2, name


def test_no_grad_evaluation_and_retain_graph_refused():
    model = GPTModel(_tiny(untied=False))
    model.loss_head = ChunkedCrossEntropy(chunk_size=8)
    tokens, labels = torch.randint(0, 96, (2, 12)), torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        ref = GPTModel.loss(model(tokens), labels)
        assert torch.allclose(model(tokens, labels=labels), ref, rtol=1e-6, atol=1e-6)
    loss = model(tokens, labels=labels).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_bad_chunk_size_is_a_clear_error():
    with pytest.raises(ValueError, match="--cross-entropy-chunk-size"):
        ChunkedCrossEntropy(chunk_size=0)


@pytest.mark.slow
def test_compiled_chunk_kernels_match_and_compile_once():
    import torch._dynamo

    torch.manual_seed(3)
    h = torch.randn(64, 16, requires_grad=True)
    w = torch.randn(128, 16, requires_grad=True)
    y = torch.randint(0, 128, (64,))
    y[3] = -100
    ref = F.cross_entropy(h @ w.t(), y, reduction="none")
    ref_gh, ref_gw = torch.autograd.grad(ref.sum(), (h, w))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # earlier tests in this process may have compiled graphs
    for _ in range(2):  # a second call reuses the compiled kernels (compiled, all rows go in one call)
        out = chunked_cross_entropy(h, w, y, 16, compile=True)
        gh, gw = torch.autograd.grad(out.sum(), (h, w))
    assert _rel(out, ref) < 1e-5 and _rel(gh, ref_gh) < 1e-5 and _rel(gw, ref_gw) < 1e-5
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # the loss and the gradient kernels


def test_compiled_chunk_work_takes_all_rows_in_one_call():
    """Compiled kernels keep float32 in registers, so chunking would only add host round trips."""
    from megatrain.runtime.fused_loss import _rows_per_call
    assert _rows_per_call(8192, 1024, compile=True) == 8192
    assert _rows_per_call(8192, 1024, compile=False) == 1024


def test_sft_objective_trains_the_responses_with_the_labeled_rows_only_head():
    """Fine-tuning ignores the prompts' labels, so its chunked head computes the response rows alone: the
    masked loss and every gradient equal the pre-training objective's over every row."""
    from megatrain.data.batch import CausalLMBatch
    from megatrain.models.gpt.objective import CausalLMObjective
    from megatrain.training.finetune import SFTObjective

    torch.manual_seed(3)
    model = GPTModel(_tiny(True))
    tokens, labels = torch.randint(0, 96, (2, 24)), torch.randint(0, 96, (2, 24))
    loss_mask = torch.zeros(2, 24)
    loss_mask[0, 15:], loss_mask[1, 20:] = 1, 1  # the responses; the prompts before them
    batch = CausalLMBatch(tokens=tokens, labels=labels, loss_mask=loss_mask)
    results = []
    for objective, head in ((CausalLMObjective(), ChunkedCrossEntropy(chunk_size=8)),
                            (SFTObjective(), ChunkedCrossEntropy(chunk_size=8, labeled_rows_only=True))):
        model.loss_head = head
        model.zero_grad(set_to_none=True)
        ((loss, count),) = objective.losses(objective.forward(model, batch), objective.loss_target(batch))
        (loss / count).backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ref, ref_grads), (out, grads) = results
    assert _rel(out, ref) < 1e-6
    for name, g in ref_grads.items():
        assert _rel(grads[name], g) < 1e-5, name
