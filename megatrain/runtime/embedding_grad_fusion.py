"""The tied word embedding's gradient added, row by row, into the output weight's staged gradient.

With tied embeddings (GPT's default) one float32 weight ``W`` [V, h] is read twice: by the word
embedding at the start of the forward and by the output layer at its end. Under the
gradient-accumulation fusion (:mod:`megatrain.runtime.grad_accumulation_fusion`) the output layer's
weight-gradient matmul writes or adds into a staged float32 buffer; the embedding's backward, left
to autograd, would make a dense [V, h] gradient (a pass writing zeros over a gigabyte at a 1.7B
shape, for a few thousand rows) which autograd then adds to the buffer (another two gigabytes read,
one written), every micro-batch. Here the embedding's backward adds its rows into the same buffer
instead (:class:`FusedGradEmbedding`, the fusion's companion of the output layer's holder) and gives
autograd no gradient for ``W``; the buffer is then ``W``'s gradient, as the output layer returns it.

The rows are added with ``index_put_(..., accumulate=True)``: on CUDA a stable sort of the token ids and
one ordered sum per id (deterministic, as torch's own embedding backward); on the CPU torch's kernel
(deterministic under ``torch.use_deterministic_algorithms``).
The output layer's backward runs first (the embedding's input gradient depends on it), so the rows
land on the written buffer; a buffer with no values yet (:func:`take_unwritten`) is zeroed first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.compiler_disable import compiler_disable
from megatrain.runtime.grad_accumulation_fusion import take_unwritten

__all__ = ["FusedGradEmbedding", "convert_tied_embeddings", "embedding_rows_"]


def _add_rows(main_grad: torch.Tensor, ids: torch.Tensor, grad_rows: torch.Tensor) -> None:
    """main_grad[ids[i]] += grad_rows[i] for every token i, in float32 (main_grad's dtype)."""
    if take_unwritten(main_grad):
        main_grad.zero_()
    rows = grad_rows.reshape(-1, main_grad.shape[-1]).to(main_grad.dtype)
    main_grad.index_put_((ids.reshape(-1),), rows, accumulate=True)


# An opaque operator (as the fusion's weight-gradient operators): it runs inside backward passes and
# writes a tensor the compiler sees as a saved input.
_LIB = torch.library.Library("megatrain", "FRAGMENT")
_LIB.define("embedding_rows_(Tensor(a!) main_grad, Tensor ids, Tensor grad_rows) -> ()")
_LIB.impl("embedding_rows_", _add_rows, "CompositeExplicitAutograd")


@torch.library.register_fake("megatrain::embedding_rows_", lib=_LIB)
def _(main_grad: torch.Tensor, ids: torch.Tensor, grad_rows: torch.Tensor) -> None:
    return None


embedding_rows_ = torch.ops.megatrain.embedding_rows_.default


class _RowsIntoStagedFn(torch.autograd.Function):
    """y = weight[ids]; the weight's gradient rows go into ``staged`` (autograd gets none). ``staged``
    is held as it is, not as a saved tensor: the output layer's backward writes it in place before
    this one runs, which a saved tensor's version check would refuse."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.staged = staged
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ids, = ctx.saved_tensors
        if ctx.needs_input_grad[1]:
            embedding_rows_(ctx.staged, ids, grad)
        ctx.staged = None
        return None, None, None


@compiler_disable  # a whole-model compile runs the lookup eagerly (its context holds a plain tensor)
def _rows_into_staged(ids: torch.Tensor, weight: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
    return _RowsIntoStagedFn.apply(ids, weight, staged)


@compiler_disable  # the same compiled regions as _rows_into_staged's (see FusedGradEmbedding.forward)
def _lookup_outside_compile(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


class FusedGradEmbedding(nn.Embedding):
    """``nn.Embedding`` whose weight-gradient rows go into ``main_grad_in`` while the fusion stages
    it (a training micro-batch); a plain embedding otherwise. Made by :func:`convert_tied_embeddings`.

    With gradients on and nothing staged (the fusion detached it: CUDA-graph recording) the lookup
    still runs outside a whole-model compile, so the compiled regions, and with them the forward's
    rounding, are those of the staged path: a run with CUDA graphs computes what one without computes."""

    main_grad_in: torch.Tensor | None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return F.embedding(ids, self.weight)
        staged = self.main_grad_in
        if staged is None:
            return _lookup_outside_compile(ids, self.weight)
        return _rows_into_staged(ids, self.weight, staged)


def convert_tied_embeddings(model: nn.Module, weight: torch.Tensor) -> list[FusedGradEmbedding]:
    """Turn the plain ``nn.Embedding`` modules of ``model`` that read ``weight`` (the output layer's,
    tied) into :class:`FusedGradEmbedding`, in place; those without padding index, norm clipping,
    frequency scaling or sparse gradients only (their backward is the plain rows' sum)."""
    out = []
    for m in model.modules():
        if type(m) is nn.Embedding and m.weight is weight and m.padding_idx is None and m.max_norm is None \
                and not m.scale_grad_by_freq and not m.sparse:
            m.__class__ = FusedGradEmbedding
            m.main_grad_in = None
            out.append(m)
    return out
