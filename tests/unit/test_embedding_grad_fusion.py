"""The tied word embedding's gradient rows added into the output weight's staged gradient
(megatrain.runtime.embedding_grad_fusion): the sum a dense embedding gradient would add, the same bits
every run, a buffer with no values yet zeroed first; in a GPT under the fusion, eager and with the
whole model compiled, the gradients of autograd's dense path."""

from __future__ import annotations

import copy

import pytest
import torch

from megatrain.models.gpt import GPTModel
from megatrain.models.gpt.config import GPTConfig
from megatrain.runtime.embedding_grad_fusion import FusedGradEmbedding, convert_tied_embeddings, embedding_rows_
from megatrain.runtime.fused_loss import ChunkedCrossEntropy
from megatrain.runtime.grad_accumulation_fusion import _UNWRITTEN, GradAccumulationFusion, convert_linears

GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=96, max_position_embeddings=16,
           ffn_hidden_size=64, hidden_dropout=0.0, attention_dropout=0.0)


def test_rows_add_what_the_dense_gradient_adds_and_the_same_bits_every_run():
    g = torch.Generator().manual_seed(0)
    staged = torch.randn(50, 8, generator=g)
    ids = torch.tensor([[3, 7, 3, 49], [0, 3, 7, 7]])  # repeated ids: their rows are summed
    rows = torch.randn(2, 4, 8, generator=g)
    dense = torch.zeros(50, 8).index_add_(0, ids.reshape(-1), rows.reshape(-1, 8))
    runs = []
    for _ in range(2):
        out = staged.clone()
        embedding_rows_(out, ids, rows)
        runs.append(out)
    torch.testing.assert_close(runs[0], staged + dense, rtol=1e-6, atol=1e-6)
    assert torch.equal(runs[0], runs[1])
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[ids.reshape(-1)] = False
    assert torch.equal(runs[0][untouched], staged[untouched])  # only the tokens' rows are read or written


def test_a_buffer_without_values_is_zeroed_first():
    ids = torch.tensor([1, 1, 4])
    rows = torch.ones(3, 2)
    staged = torch.full((6, 2), float("nan"))  # what an unfilled buffer may hold
    _UNWRITTEN.clear()
    _UNWRITTEN.add(staged.data_ptr())
    embedding_rows_(staged, ids, rows)
    assert not _UNWRITTEN
    assert staged.tolist() == [[0, 0], [2, 2], [0, 0], [0, 0], [1, 1], [0, 0]]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_gpt_under_the_fusion_gets_autograds_gradients(compiled):
    """Against the same model whose embedding gradient autograd makes dense and adds (eager); the
    model with the rows path run eagerly or compiled whole (the lookup then runs eagerly)."""
    torch.manual_seed(0)
    models = [GPTModel(GPTConfig(**GPT))]
    models.append(copy.deepcopy(models[0]))
    fusions = []
    for rows, m in zip((False, True), models):
        m.loss_head = ChunkedCrossEntropy(8)
        linears = convert_linears(x for layer in m.layers.values() for x in layer.modules())
        embeddings = convert_tied_embeddings(m, m.output_weight()) if rows else []
        fusions.append(GradAccumulationFusion(linears, torch.float32, [(m.loss_head, m.output_weight())],
                                              embeddings=embeddings))
    assert type(models[1].embedding.word_embeddings) is FusedGradEmbedding
    tokens = [torch.randint(0, 96, (2, 16)) for _ in range(3)]
    grads: list[list[dict[str, torch.Tensor]]] = [[], []]
    for i, (m, fusion) in enumerate(zip(models, fusions)):
        run = torch.compile(m) if compiled and i == 1 else m
        for batches in (tokens, tokens[:1]):  # several micro-batches, then one (fresh)
            m.zero_grad(set_to_none=True)
            fusion.refresh()
            for t in batches:
                fusion.stage(fresh=len(batches) == 1)
                loss = run(t, labels=t.roll(-1, 1)).mean()
                fusion.release()
                loss.backward()
                fusion.merge_held()
            grads[i].append({n: p.grad.clone() for n, p in m.named_parameters()})
    for step, (ref, got) in enumerate(zip(*grads)):
        assert ref.keys() == got.keys()
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6 * ref[name].abs().max().item(),
                                       msg=f"step {step}: {name}")


def test_a_detached_embedding_keeps_the_staged_paths_compiled_regions():
    """CUDA-graph recording detaches the tied embedding (autograd's dense gradient); under a whole-model
    compile its lookup still runs outside the compiled regions, so the graphs (and the forward's rounding)
    are those of a run without CUDA graphs, and the losses the same bits."""
    torch.manual_seed(0)
    base = GPTModel(GPTConfig(**GPT))
    t = torch.randint(0, 96, (2, 16))
    results = []
    for detach in (False, True):
        m = copy.deepcopy(base)
        m.loss_head = ChunkedCrossEntropy(8)
        linears = convert_linears(x for layer in m.layers.values() for x in layer.modules())
        fusion = GradAccumulationFusion(linears, torch.float32, [(m.loss_head, m.output_weight())],
                                        embeddings=convert_tied_embeddings(m, m.output_weight()))
        if detach:
            fusion.detach_embeddings()
        fusion.refresh()
        fusion.stage()
        torch._dynamo.reset()
        explained = torch._dynamo.explain(m)(t, labels=t.roll(-1, 1))
        fusion.release()
        fusion.stage()
        loss = torch.compile(m)(t, labels=t.roll(-1, 1)).mean()
        fusion.release()
        loss.backward()
        results.append((explained.graph_count, explained.graph_break_count, loss.detach()))
    (graphs, breaks, staged_loss), (graphs_d, breaks_d, detached_loss) = results
    assert breaks >= 1 and (graphs_d, breaks_d) == (graphs, breaks)
    assert torch.equal(detached_loss, staged_loss)
