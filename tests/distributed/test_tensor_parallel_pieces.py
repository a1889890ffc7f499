"""Each tensor-parallel piece against the plain module it replaces, and the dropout RNG rules.

One 2-process gloo job computes every check; the tests below read its results.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from dist_harness import run_workers, tiny_config, train_layout

from megatrain.models.common.attention import SelfAttention
from megatrain.models.gpt import GPTModel, TransformerLayer
from megatrain.models.common.mlp import MLP
from megatrain.parallel.dims import ParallelDims
from megatrain.parallel.random import TensorParallelRNG
from megatrain.parallel.tensor_parallel import layer_plan, vocab_parallel_cross_entropy


def _sub_plan(prefix: str, sequence_parallel: bool = False) -> dict:
    return {k[len(prefix):]: v for k, v in layer_plan(sequence_parallel).items() if k.startswith(prefix)}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grad_error(plain: nn.Module, parallel: nn.Module) -> float:
    worst = 0.0
    for (name, p), (_, q) in zip(plain.named_parameters(), parallel.named_parameters()):
        worst = max(worst, (p.grad - _full(q.grad)).abs().max().item() / p.grad.abs().max().clamp(min=1e-12).item())
    return worst


def _compare(plain: nn.Module, parallel: nn.Module, x: torch.Tensor, call, *, shard_seq: bool = False,
             tp_mesh=None) -> dict[str, float]:
    """Forward and backward of both modules on x; the parallel one may take/return sequence shards."""
    x_plain = x.clone().requires_grad_(True)
    out_plain = call(plain, x_plain)
    out_plain.pow(2).sum().backward()
    if shard_seq:
        rank, tp = tp_mesh.get_local_rank(), tp_mesh.size()
        x_par = x.chunk(tp, dim=1)[rank].clone().requires_grad_(True)
        out_par = call(parallel, x_par)
        out_ref = out_plain.chunk(tp, dim=1)[rank]
        grad_ref = x_plain.grad.chunk(tp, dim=1)[rank]
    else:
        x_par = x.clone().requires_grad_(True)
        out_par = call(parallel, x_par)
        out_ref, grad_ref = out_plain, x_plain.grad
    out_par.pow(2).sum().backward()
    return {"out": (out_par - out_ref).abs().max().item(), "input_grad": (x_par.grad - grad_ref).abs().max().item(),
            "param_grad_rel": _grad_error(plain, parallel)}


def _module_checks(tp_mesh) -> dict[str, dict[str, float]]:
    out = {}
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    for style in ("gpt2", "llama"):  # llama: GQA (2 groups over 2 ranks), SwiGLU, no biases
        config = tiny_config(style)
        attn = SelfAttention(config, 0)
        attn_tp = parallelize_module(copy.deepcopy(attn), tp_mesh, _sub_plan("self_attention."))
        out[f"attention_{style}"] = _compare(attn, attn_tp, x, lambda m, t: m(t))
        mlp = MLP(config)
        for p in mlp.parameters():
            nn.init.normal_(p, std=0.1)
        mlp_tp = parallelize_module(copy.deepcopy(mlp), tp_mesh, _sub_plan("mlp."))
        out[f"mlp_{style}"] = _compare(mlp, mlp_tp, x, lambda m, t: m(t))
        layer = TransformerLayer(config, 0)
        for name, p in layer.named_parameters():
            nn.init.normal_(p, mean=1.0 if "layernorm" in name else 0.0, std=0.1)
        layer_sp = parallelize_module(copy.deepcopy(layer), tp_mesh, layer_plan(sequence_parallel=True))
        out[f"layer_sequence_parallel_{style}"] = _compare(layer, layer_sp, x, lambda m, t: m(t), shard_seq=True,
                                                           tp_mesh=tp_mesh)
    embedding = nn.Embedding(64, 32)
    embedding_tp = parallelize_module(copy.deepcopy(embedding), tp_mesh,
                                      RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    ids = torch.randint(0, 64, (2, 8))
    emb_plain, emb_par = embedding(ids), embedding_tp(ids)
    emb_plain.pow(2).sum().backward()
    emb_par.pow(2).sum().backward()
    out["vocab_parallel_embedding"] = {"out": (emb_par - emb_plain).abs().max().item(),
                                       "param_grad_rel": _grad_error(embedding, embedding_tp)}
    return out


def _loss_checks(tp_mesh) -> dict[str, float]:
    torch.manual_seed(1)
    logits = torch.randn(3, 5, 64) * 4
    labels = torch.randint(0, 64, (3, 5))
    labels[0, :2] = -100
    full = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(full.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    weights = torch.rand(3, 5)
    (ref * weights).sum().backward()
    rank, tp = tp_mesh.get_local_rank(), tp_mesh.size()
    local = logits.chunk(tp, dim=-1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, labels, group=tp_mesh.get_group())
    (loss * weights).sum().backward()
    as_dtensor = distribute_tensor(logits, tp_mesh, [Shard(2)])
    loss_dt = vocab_parallel_cross_entropy(as_dtensor, labels)
    out = {"loss": (loss - ref).abs().max().item(), "dtensor_loss": (loss_dt - ref).abs().max().item(),
           "grad": (local.grad - full.grad.chunk(tp, dim=-1)[rank]).abs().max().item(),
           "ignored_are_zero": float(loss[0, :2].abs().max().item())}
    # Chunked: 15 tokens in chunks of 4 (a remainder chunk), targets in both shards and ignored ones.
    local = logits.chunk(tp, dim=-1)[rank].clone().requires_grad_(True)
    chunked = vocab_parallel_cross_entropy(local * 1.0, labels, group=tp_mesh.get_group(), chunk_size=4)
    (chunked * weights).sum().backward()
    out.update(chunked_loss=(chunked - ref).abs().max().item(),
               chunked_grad=(local.grad - full.grad.chunk(tp, dim=-1)[rank]).abs().max().item(),
               chunked_ignored_are_zero=float(chunked[0, :2].abs().max().item()))
    return out


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _rng_checks(dims: ParallelDims) -> dict[str, bool]:
    out: dict[str, bool] = {}
    rng = TensorParallelRNG(dims.tp_rank)
    torch.manual_seed(7)
    with rng.fork():
        inside = torch.rand(16)
    after = torch.rand(16)
    torch.manual_seed(7)
    torch.randint(0, 2**31 - 1, ())
    out["fork_consumes_one_draw"] = torch.equal(after, torch.rand(16))
    a, b = _gather(inside)
    out["fork_differs_across_tp"] = not torch.equal(a, b)
    a, b = _gather(after)
    out["outside_fork_agrees_across_tp"] = torch.equal(a, b)

    for sp in (False, True):
        config = tiny_config("gpt2", attention_dropout=0.5, hidden_dropout=0.5)
        with torch.device("meta"):
            model = GPTModel(config)
        from megatrain.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, dims.submesh("tp"), sequence_parallel=sp)
        model.train()
        layer = model.layers["0"]
        torch.manual_seed(3)
        q = torch.randn(2, 2, 8, 8)  # [b, local heads, s, d]: the same on both ranks
        attn_out = layer.self_attention.core_attention(q, q, q, None, 0)
        a, b = _gather(attn_out)
        out[f"attention_dropout_differs_sp{int(sp)}"] = not torch.equal(a, b)
        hidden = layer.dropout(torch.ones(2, 8, 32))
        a, b = _gather(hidden)
        key = "residual_dropout_differs_sp1" if sp else "residual_dropout_agrees_sp0"
        out[key] = (not torch.equal(a, b)) if sp else torch.equal(a, b)
    return out


def _train_with_dropout(sp: bool, recompute: str) -> tuple[list[float], dict]:
    """Three iterations of the real trainer under TP 2, dropout on, with the recompute flags."""
    flags = "--tensor-model-parallel-size 2" + (" --sequence-parallel" if sp else "") + recompute
    run = train_layout("llama" if sp else "gpt2", flags, steps=3, dropout=0.2)
    return run.losses, run.params


def _dropout_training_checks() -> dict[str, float | bool]:
    out: dict[str, float | bool] = {}
    for sp in (False, True):
        base_losses, base = _train_with_dropout(sp, "")
        for name, rc in (("full", " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"),
                         ("selective", " --recompute-granularity selective")):
            losses, params = _train_with_dropout(sp, rc)
            out[f"recompute_{name}_sp{int(sp)}"] = max(
                max(abs(a - b) for a, b in zip(losses, base_losses)),
                max((params[k] - base[k]).abs().max().item() for k in base))
        # Replicated parameters must stay identical on the tensor-parallel ranks.
        same = True
        for k, v in base.items():
            a, b = _gather(v)
            same = same and torch.equal(a, b)
        out[f"replicas_identical_sp{int(sp)}"] = same
    return out


def _all_checks(rank: int, world_size: int) -> dict:
    dims = ParallelDims(world_size, tp=2)
    dims.build_mesh("cpu")
    tp_mesh = dims.submesh("tp")
    return {"modules": _module_checks(tp_mesh), "loss": _loss_checks(tp_mesh), "rng": _rng_checks(dims),
            "dropout_training": _dropout_training_checks()}


@pytest.fixture(scope="module")
def results():
    return run_workers(_all_checks, 2)


MODULES = [f"{kind}_{style}" for style in ("gpt2", "llama") for kind in ("attention", "mlp", "layer_sequence_parallel")]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES + ["vocab_parallel_embedding"])
def test_parallel_module_matches_plain(results, name):
    for per_rank in results:
        r = per_rank["modules"][name]
        assert r["out"] < 1e-5, r
        assert r.get("input_grad", 0.0) < 1e-5, r
        assert r["param_grad_rel"] < 1e-5, r


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(results):
    for per_rank in results:
        r = per_rank["loss"]
        assert r["loss"] < 1e-5 and r["dtensor_loss"] < 1e-5 and r["grad"] < 1e-6, r
        assert r["ignored_are_zero"] == 0.0
        assert r["chunked_loss"] < 1e-5 and r["chunked_grad"] < 1e-6 and r["chunked_ignored_are_zero"] == 0.0, r


@pytest.mark.slow
@pytest.mark.parametrize("check", ["fork_consumes_one_draw", "fork_differs_across_tp", "outside_fork_agrees_across_tp",
                                   "attention_dropout_differs_sp0", "attention_dropout_differs_sp1",
                                   "residual_dropout_agrees_sp0", "residual_dropout_differs_sp1"])
def test_dropout_rng_rules(results, check):
    assert all(per_rank["rng"][check] for per_rank in results)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [0, 1])
def test_dropout_training_replays_under_recompute_and_keeps_replicas_equal(results, sp):
    for per_rank in results:
        r = per_rank["dropout_training"]
        assert r[f"recompute_full_sp{sp}"] == 0.0, r
        assert r[f"recompute_selective_sp{sp}"] == 0.0, r
        assert r[f"replicas_identical_sp{sp}"], r
