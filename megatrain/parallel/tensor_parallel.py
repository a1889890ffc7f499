"""Tensor and sequence parallelism: a family's plan by module path applied with DTensor, and the
vocab-parallel loss.

The plan is data the model family gives (``ModelFamily.tensor_parallel_plan``, built from
:mod:`megatrain.models.common.tp_plan`; the GPT family's is :mod:`megatrain.models.gpt.plan`):
(module path, ``ParallelStyle``) pairs, the dropout regions to run under
:class:`megatrain.parallel.random.TensorParallelRNG`, and whether the language-model head becomes
:class:`VocabParallelLoss`. The model reads head and channel counts from tensor sizes, so the
unchanged forward code runs on the local shards.

With ``--fp8-format`` the transformer layers' linear layers are torchao ``Float8Linear`` modules and
take the same plain styles: their weights become DTensors, so every fp8 scale is computed from the
whole tensor's absolute maximum (a DTensor reduction) and the numbers equal one process's fp8 run;
the collectives move bf16/fp32 activations, not fp8.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from megatrain.models.common.tp_plan import TensorParallelPlan, transformer_layer_plan
from megatrain.models.registry import family_of_config
from megatrain.parallel.random import TensorParallelRNG
from megatrain.runtime.fused_loss import backward_once, chunk_kernel

__all__ = ["layer_plan", "apply_tensor_parallel", "enable_async_tensor_parallel", "vocab_parallel_cross_entropy",
           "VocabParallelLoss"]

layer_plan = transformer_layer_plan  # the shared transformer layer's plan (tests address it by this name)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
                          rng: TensorParallelRNG | None = None, loss_chunk_size: int = 0,
                          compile_loss: bool = False, plan: TensorParallelPlan | None = None) -> nn.Module:
    """Shard ``model`` (a family's model or one of its pipeline stages) in place by ``plan`` (default:
    its family's plan for ``model``).

    With a vocab-parallel head, ``model(..., labels=...)`` then returns the per-token loss as a plain
    tensor computed with the vocab-parallel cross entropy (float32 statistics ``loss_chunk_size``
    tokens at a time when that is > 0, see ``--cross-entropy-chunk-size``); ``model(...)`` without
    labels returns the logits as a DTensor sharded on the vocabulary (``.full_tensor()`` gathers them).
    """
    if plan is None:
        plan = family_of_config(model.config).tensor_parallel_plan(model, sequence_parallel=sequence_parallel)
    if rng is None:
        rng = TensorParallelRNG(tp_mesh.get_local_rank(), tp_mesh.device_type)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    for path, style in plan.styles:
        parallelize_module(model.get_submodule(path), tp_mesh, style)
    for name, p in model.named_parameters():  # torch's SequenceParallel re-creates norm parameters
        if name in frozen:                     # as trainable ones: frozen parts stay frozen
            p.requires_grad_(False)
    for path in plan.rng_regions:
        rng.fork_module(model.get_submodule(path))
    if plan.vocab_parallel_head:  # the vocab-parallel loss never gathers the logits
        model.loss_head = VocabParallelLoss(tp_mesh, chunk_size=loss_chunk_size, compile=compile_loss)
    return model


def enable_async_tensor_parallel(tp_mesh: DeviceMesh) -> None:
    """``--tp-comm-overlap``: let inductor's micro-pipeline TP pass rewrite each compiled layer's
    all-gather -> matmul and matmul -> reduce-scatter pairs into overlapped collective matmuls over
    symmetric memory on ``tp_mesh`` (CUDA only; a process-wide inductor setting)."""
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True
    from torch.distributed import _symmetric_memory

    enable = getattr(_symmetric_memory, "enable_symm_mem_for_group", None)
    if enable is not None:  # newer torch versions enable symmetric memory on demand
        enable(tp_mesh.get_group().group_name)


# ---- vocab-parallel cross entropy ----------------------------------------------------------------

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits whose last dim is split across ``group``; never gathers them."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any,
                ignore_index: int) -> torch.Tensor:
        logits = logits.float()
        local_vocab = logits.shape[-1]
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)

        in_shard = (target >= vocab_start) & (target < vocab_start + local_vocab)
        local_target = torch.where(in_shard, target - vocab_start, torch.zeros_like(target))
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * in_shard
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack((target_logit, sum_exp))
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        target_logit, sum_exp = both[0], both[1]

        keep = target != ignore_index
        loss = (sum_exp.log() - target_logit) * keep
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, in_shard, keep)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:
        softmax, local_target, in_shard, keep = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -in_shard.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * keep).unsqueeze(-1))
        return grad, None, None, None, None


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    """The same loss with float32 only ``chunk_size`` tokens at a time.

    The logits' own buffer (compute dtype, [N, V/tp]) is the only tensor of that size: the forward
    reads it chunk by chunk for each row's shard maximum, sum of exponentials and target logit,
    two all-reduces of [N]-sized vectors combine the shards (max, then the rescaled sums), and the
    backward overwrites the buffer with the gradient chunk by chunk (so it runs once).
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any,
                ignore_index: int, chunk_size: int, compile: bool) -> torch.Tensor:
        stats = chunk_kernel("shard_stats", compile)
        n, local_vocab = logits.shape
        in_shard = (target >= vocab_start) & (target < vocab_start + local_vocab)
        local_target = torch.where(in_shard, target - vocab_start, torch.full_like(target, -1))
        f32 = torch.promote_types(logits.dtype, torch.float32)
        row_max, sum_exp, target_logit = (torch.empty(n, dtype=f32, device=logits.device) for _ in range(3))
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            row_max[start:end], sum_exp[start:end], target_logit[start:end] = stats(
                logits[start:end], local_target[start:end])
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        both = torch.stack((sum_exp * torch.exp(row_max - global_max), target_logit))
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        lse = global_max + both[0].log()
        keep = target != ignore_index
        loss = torch.where(keep, lse - both[1], torch.zeros_like(lse))
        ctx.save_for_backward(logits, lse, local_target, keep)
        ctx.config = (chunk_size, compile)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:
        backward_once(ctx, "the chunked vocab-parallel cross entropy")
        logits, lse, local_target, keep = ctx.saved_tensors
        chunk_size, compile = ctx.config
        grad_fn = chunk_kernel("grad", compile)
        g = torch.where(keep, grad_loss.to(lse.dtype), torch.zeros_like(lse))  # ignored tokens: no gradient
        for start in range(0, logits.shape[0], chunk_size):
            end = min(start + chunk_size, logits.shape[0])
            # Targets in other shards are -1 (no column matches); -2 is an ignore index no target has.
            grad_fn(logits[start:end], lse[start:end], local_target[start:end], g[start:end], -2)
        return logits, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, group: Any = None,
                                 vocab_start: int | None = None, ignore_index: int = -100,
                                 chunk_size: int = 0, compile: bool = False) -> torch.Tensor:
    """Per-token cross entropy (float32, shape of ``target``) of vocab-sharded ``logits``.

    ``logits`` [..., V/tp] is this rank's contiguous slice of the vocabulary starting at
    ``vocab_start`` (default ``rank_in_group * V/tp``), or a DTensor sharded on its last dim.
    Tokens labelled ``ignore_index`` get 0, as with ``F.cross_entropy``. ``chunk_size`` > 0 keeps
    float32 to that many tokens at a time (the logits' gradient then overwrites their buffer);
    ``compile`` runs the per-chunk work as torch.compile kernels.
    """
    if isinstance(logits, DTensor):
        (placement,) = logits.placements
        assert isinstance(placement, Shard) and placement.dim in (-1, logits.ndim - 1), logits.placements
        mesh = logits.device_mesh
        group = mesh.get_group()
        local = logits.to_local()
        vocab_start = mesh.get_local_rank() * local.shape[-1]
        logits = local
    if vocab_start is None:
        vocab_start = dist.get_rank(group) * logits.shape[-1]
    if chunk_size > 0:
        flat = _ChunkedVocabParallelCrossEntropy.apply(logits.flatten(0, -2), target.flatten(), vocab_start, group,
                                                       ignore_index, int(chunk_size), bool(compile))
    else:
        flat = _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), target.flatten(), vocab_start, group,
                                                ignore_index)
    return flat.view(target.shape)


class VocabParallelLoss:
    """The loss head under tensor parallelism (logits sharded on the vocabulary; see
    :mod:`megatrain.models.common.heads`)."""

    def __init__(self, tp_mesh: DeviceMesh, *, chunk_size: int = 0, compile: bool = False) -> None:
        self.tp_mesh = tp_mesh
        self.chunk_size, self.compile = chunk_size, compile

    def per_token_loss(self, model: Any, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self(model.logits(hidden), labels)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        kwargs = {"chunk_size": self.chunk_size, "compile": self.compile}
        if isinstance(logits, DTensor):
            return vocab_parallel_cross_entropy(logits, labels, **kwargs)
        return vocab_parallel_cross_entropy(logits, labels, group=self.tp_mesh.get_group(),
                                            vocab_start=self.tp_mesh.get_local_rank() * logits.shape[-1], **kwargs)
