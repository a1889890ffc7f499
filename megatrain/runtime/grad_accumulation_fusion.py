"""Linear layers that compute with a half-precision copy of their weight and accumulate the weight
gradient in float32 inside the weight-gradient matmul (Megatron's ``--gradient-accumulation-fusion``).

Under plain autocast a float32 weight is cast to bf16 in every micro-batch's forward, the
weight-gradient matmul writes a bf16 gradient, autograd casts it back to float32 and adds it to
``.grad``: four passes over every weight per micro-batch, and the gradient rounded to bf16 before
it is summed. Here, for the ``nn.Linear`` modules of the transformer layers (and, through the
same protocol, the output weight inside the chunked loss, :mod:`megatrain.runtime.fused_loss`):

* the parameter stays the float32 master weight (optimizer, clipping, checkpoints and data
  parallelism see no difference); a half-precision copy (``half_weight``) is refreshed once per
  optimizer step by one multi-tensor copy, and the forward and input-gradient matmuls use it;
* the weight gradient is added to the gradient accumulated so far by one matmul that reads and
  writes it in float32 (``addmm(..., out_dtype=float32, out=main_grad)`` on CUDA, torch >= 2.8;
  elsewhere the same maths through a float32 matmul), the opaque operator
  ``megatrain::accumulate_wgrad_``. Before each micro-batch :meth:`GradAccumulationFusion.stage`
  moves each weight's ``.grad`` into ``main_grad_in`` and clears ``.grad`` (on a step's first
  micro-batch it stages new buffers without values, which the matmuls write instead of adding to:
  no zero-filling pass);
  the backward returns that same tensor, updated in place, and autograd takes it as the new
  ``.grad`` without a copy or another addition. An optimizer step of a single micro-batch stages
  nothing (``stage(fresh=True)``): its weight-gradient matmuls write new float32 gradients, with no
  zero-filled buffers to write and read.

The numbers are the autocast path's in the forward; the weight gradients are more exact (no bf16
rounding of each micro-batch's contribution). A layer called without staged gradients (evaluation,
generation, a plain ``backward``) gets its weight gradient added by autograd as usual.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.runtime.fp8_scaling import promote_

__all__ = ["FusedGradLinear", "GradAccumulationFusion", "accumulate_wgrad_", "convert_linears", "wgrad_float32"]


def _half_on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16)


# How this torch multiplies half-precision operands into a float32 result on CUDA: "addmm" (one
# matmul reading and writing the accumulator, torch >= 2.8), "mm" (a float32 product, then an
# addition) or "rounded" (the product rounded to the operands' dtype first, as under plain
# autocast); the first that works is kept, with a warning when it is not "addmm".
_CUDA_PATH = ["addmm"]


def _fall_back(to: str, error: Exception) -> None:
    _CUDA_PATH[0] = to
    how = {"mm": "a float32 matmul, then an addition",
           "rounded": "the product rounded to the operands' dtype, then an addition"}[to]
    warnings.warn(f"gradient-accumulation fusion: this torch cannot run the fused float32 matmul "
                  f"({type(error).__name__}: {error}); using {how}", RuntimeWarning, stacklevel=3)


def _product_float32(grad_out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """grad_out^T @ inp as a new float32 tensor."""
    if not _half_on_cuda(grad_out):
        return grad_out.t().float() @ inp.float()
    if _CUDA_PATH[0] != "rounded":
        try:
            return torch.mm(grad_out.t(), inp, out_dtype=torch.float32)
        except (TypeError, RuntimeError) as e:
            _fall_back("rounded", e)
    return (grad_out.t() @ inp).float()


def _wgrad_new(grad_out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """grad_out^T @ inp in float32 (opaque to the compiler, like :func:`accumulate_wgrad_`)."""
    return _product_float32(grad_out, inp)


# The staged gradient buffers (by address) that hold no values yet: the first micro-batch of a step with
# several stages fresh, uninitialised buffers, and the accumulating operators write the first product into
# them instead of adding it to zeros (no zero-filling pass, no read of the zeros). The operators are opaque
# to the compiler, so this is decided when they run, not when a graph is traced. Set by
# GradAccumulationFusion.stage, emptied by its next stage or merge_held.
_UNWRITTEN: set[int] = set()


def take_unwritten(main_grad: torch.Tensor) -> bool:
    """Whether ``main_grad`` is a staged buffer without values yet (it then counts as written)."""
    if not _UNWRITTEN:
        return False
    ptr = main_grad.data_ptr()
    if ptr in _UNWRITTEN:
        _UNWRITTEN.discard(ptr)
        return True
    return False


def _unfilled(like: torch.Tensor) -> torch.Tensor:
    """A staged buffer shaped as ``like`` that the first product written into it fills (no zeros first)."""
    buffer = torch.empty_like(like)
    _UNWRITTEN.add(buffer.data_ptr())
    return buffer


def _accumulate_wgrad(main_grad: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor) -> None:
    """main_grad += grad_out^T @ inp in place (an opaque operator: the compiler keeps it as one
    matmul with beta = 1 instead of a matmul and a separate addition); main_grad = grad_out^T @ inp
    where main_grad holds no values yet (:func:`take_unwritten`)."""
    beta = 0.0 if take_unwritten(main_grad) else 1.0  # beta 0: the old contents are not read
    if not _half_on_cuda(grad_out):
        main_grad.addmm_(grad_out.t().to(main_grad.dtype), inp.to(main_grad.dtype), beta=beta)
        return
    if _CUDA_PATH[0] == "addmm":
        try:
            torch.addmm(main_grad, grad_out.t(), inp, beta=beta, out_dtype=torch.float32, out=main_grad)
            return
        except (TypeError, RuntimeError) as e:
            _fall_back("mm", e)
    if beta == 0.0:
        main_grad.copy_(_product_float32(grad_out, inp))
    else:
        main_grad.add_(_product_float32(grad_out, inp))


# The two operators are registered on the dispatcher directly, with one implementation for every
# device and no autograd formula (they run inside backward passes): a call costs about a third of
# what ``torch.library.custom_op``'s Python autograd and view wrappers add (9 against 24 us on a
# CPU), and a small model's backward calls them once per weight and micro-batch.
_LIB = torch.library.Library("megatrain", "FRAGMENT")
_LIB.define("wgrad_float32(Tensor grad_out, Tensor inp) -> Tensor")
_LIB.define("accumulate_wgrad_(Tensor(a!) main_grad, Tensor grad_out, Tensor inp) -> ()")
_LIB.impl("wgrad_float32", _wgrad_new, "CompositeExplicitAutograd")
_LIB.impl("accumulate_wgrad_", _accumulate_wgrad, "CompositeExplicitAutograd")


@torch.library.register_fake("megatrain::wgrad_float32", lib=_LIB)
def _(grad_out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    return grad_out.new_empty((grad_out.shape[1], inp.shape[1]), dtype=torch.float32)


@torch.library.register_fake("megatrain::accumulate_wgrad_", lib=_LIB)
def _(main_grad: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor) -> None:
    return None


wgrad_new = torch.ops.megatrain.wgrad_float32.default
accumulate_wgrad_ = torch.ops.megatrain.accumulate_wgrad_.default


def wgrad_float32(prev: torch.Tensor | None, grad_out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """``prev + grad_out^T @ inp`` in float32, written into ``prev`` (one matmul that reads and
    writes it on CUDA), or a new tensor when ``prev`` is None."""
    if prev is None:
        return wgrad_new(grad_out, inp)
    accumulate_wgrad_(prev, grad_out, inp)
    return prev


class _FusedGradLinearFn(torch.autograd.Function):
    """y = x @ half_weight^T (+ bias); weight's gradient = prev + dY^T x in float32."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, half_weight: torch.Tensor,
                bias: torch.Tensor | None, prev: torch.Tensor | None) -> torch.Tensor:
        dtype = half_weight.dtype
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        with torch.autocast(device_type=x.device.type, enabled=False):
            if bias is None:
                y = x2 @ half_weight.t()
            else:
                y = torch.addmm(bias.to(dtype), x2, half_weight.t())
        ctx.save_for_backward(x2, half_weight, prev)
        ctx.meta = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        x2, half_weight, prev = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.meta
        g2 = grad_y.reshape(-1, grad_y.shape[-1]).to(half_weight.dtype)
        grad_x = grad_w = grad_b = None
        with torch.autocast(device_type=g2.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = (g2 @ half_weight).view(*grad_y.shape[:-1], half_weight.shape[1]).to(x_dtype)
            if ctx.needs_input_grad[1]:
                grad_w = wgrad_float32(prev, g2, x2).to(w_dtype)
            if b_dtype is not None and ctx.needs_input_grad[3]:
                grad_b = g2.sum(0, dtype=torch.float32).to(b_dtype)
        return grad_x, grad_w, None, grad_b, None


class FusedGradLinear(nn.Linear):
    """``nn.Linear`` whose matmuls use ``half_weight`` (see the module doc); made by :func:`convert_linears`."""

    half_weight: torch.Tensor | None
    main_grad_in: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.half_weight is None:  # not refreshed yet: behave as nn.Linear
            return F.linear(x, self.weight, self.bias)
        return _FusedGradLinearFn.apply(x, self.weight, self.half_weight, self.bias, self.main_grad_in)


def convert_linears(modules: Iterable[nn.Module]) -> list[FusedGradLinear]:
    """Turn every plain ``nn.Linear`` among ``modules`` into a :class:`FusedGradLinear` (in place)."""
    out = []
    for m in modules:
        if type(m) is nn.Linear:
            m.__class__ = FusedGradLinear
            m.half_weight = None
            m.main_grad_in = None
        if isinstance(m, FusedGradLinear):
            out.append(m)
    return out


def _plain_attribute_dict(holder: Any, name: str) -> dict | None:
    """``holder.__dict__`` where setting ``holder.<name>`` is a plain instance-dict write (an
    ``nn.Module`` whose ``name`` is no parameter, buffer or submodule, or a plain object), else None."""
    d = getattr(holder, "__dict__", None)
    if d is None:
        return None
    setter = type(holder).__setattr__
    if setter is nn.Module.__setattr__:
        if any(name in getattr(holder, k, {}) for k in ("_parameters", "_buffers", "_modules")):
            return None
    elif setter is not object.__setattr__:
        return None
    if isinstance(getattr(type(holder), name, None), property):
        return None
    return d


class GradAccumulationFusion:
    """The per-step protocol of a model's fused layers: its :class:`FusedGradLinear` modules and,
    optionally, further holders of a weight that follow the same convention (``half_weight`` and
    ``main_grad_in`` attributes, e.g. the chunked output-layer loss with the output weight).

    ``refresh()`` before the forward passes of an optimizer step (copies the float32 weights into
    their half-precision copies); ``stage()`` before each training micro-batch's forward;
    ``release()`` after it (the forward holds the staged gradients until its backward is done);
    ``merge_held()`` after its backward.

    ``others``: the model's remaining parameters (norms, biases, embeddings). Autograd computes
    their gradients whole; summing them over micro-batches would cost one addition kernel, launched
    by autograd, per parameter and micro-batch, which on a small model keeps the GPU waiting for
    the host. ``stage(hold_others=True)`` sets their gradients so far aside, autograd then stores the
    micro-batch's gradients without adding, and ``merge_held()`` adds them all with one multi-tensor
    addition. (Under data-parallel reduction the last micro-batch must not hold them: the reduction
    reads the gradients autograd accumulates.)
    """

    def __init__(self, linears: list[FusedGradLinear], dtype: torch.dtype,
                 extra: list[tuple[Any, torch.Tensor]] | None = None,
                 others: Iterable[torch.Tensor] = (), fp8_linears: list[Any] | None = None,
                 embeddings: list[Any] | None = None) -> None:
        assert linears or extra or fp8_linears, "no layers to fuse"
        self.linears = linears
        self.dtype = dtype
        # (holder, its float32 weight): every holder has half_weight and main_grad_in attributes
        self.half_slots: list[tuple[Any, torch.Tensor]] = [(m, m.weight) for m in linears] + list(extra or [])
        # fp8 layers (megatrain.runtime.fp8_fusion.Fp8FusedLinear): main_grad_in, and refresh_fp8()
        # instead of a half-precision copy
        self.fp8_linears = list(fp8_linears or [])
        self.slots = self.half_slots + [(m, m.weight) for m in self.fp8_linears]
        # those with delayed scaling: the scales recorded in a micro-batch take effect after its backward
        self._delayed = [m for m in self.fp8_linears if m.recipe.delayed]
        # holders whose weight also has fp8 copies to refresh (the output layer in fp8: fp8_head)
        self._fp8_holders = [(h, w) for h, w in self.half_slots if getattr(h, "fp8_weights", None) is not None]
        fused = {id(w) for _, w in self.slots}
        self.others = [p for p in others if p.requires_grad and id(p) not in fused]
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its gradient so far)
        # Per-slot state, read once: the weights, and the holders' instance dicts where a holder's
        # main_grad_in is a plain instance attribute (``nn.Module.__setattr__`` costs ~1 us a call,
        # three calls per weight and micro-batch), else None (set through setattr).
        self._weights = [w for _, w in self.slots]
        self._half_weights = [w for _, w in self.half_slots]
        self._dicts = [_plain_attribute_dict(h, "main_grad_in") for h, _ in self.slots]
        self._fast_attrs = all(d is not None for d in self._dicts)
        # tied word embeddings (megatrain.runtime.embedding_grad_fusion.FusedGradEmbedding): each adds its
        # gradient rows into the staged buffer of the slot holding its weight
        self._companions: list[tuple[Any, int]] = []
        for emb in embeddings or []:
            index = next(i for i, (_, w) in enumerate(self.slots) if w is emb.weight)
            self._companions.append((emb, index))
        self._halves: list[torch.Tensor] | None = None  # the holders' half_weight, as refresh made them
        # An optimizer that writes the half-precision copies in its own step (KernelAdamW): refresh then
        # copies only where that optimizer's copies are not current (the first step, a loaded checkpoint).
        self.copier: Any = None

    def detach_embeddings(self) -> None:
        """Leave the tied embeddings to autograd (their dense gradient added to the output layer's):
        for CUDA-graph recording, which this path is not tested under."""
        for emb, _ in self._companions:
            emb.main_grad_in = None
        self._companions = []

    def _set_main_grads(self, grads: list[torch.Tensor | None] | None) -> None:
        for emb, index in self._companions:
            emb.main_grad_in = None if grads is None else grads[index]
        if self._fast_attrs:
            if grads is None:
                for d in self._dicts:
                    d["main_grad_in"] = None
            else:
                for d, g in zip(self._dicts, grads):
                    d["main_grad_in"] = g
        else:
            for (holder, _), g in zip(self.slots, grads or [None] * len(self.slots)):
                holder.main_grad_in = g

    @torch.no_grad()
    def refresh(self) -> None:
        """Bring the weights' half-precision (and fp8) copies up to date with the float32 weights."""
        for m in self.fp8_linears:
            m.refresh_fp8()
        for holder, w in self._fp8_holders:
            holder.fp8_weights.refresh(w)
        if self.half_slots:
            self._refresh_halves()

    def _refresh_halves(self) -> None:
        halves = self._halves
        if halves is None or not all(holder.half_weight is h and h.device == w.device
                                     for (holder, w), h in zip(self.half_slots, halves)):
            for holder, w in self.half_slots:
                if holder.half_weight is None or holder.half_weight.device != w.device:
                    holder.half_weight = torch.empty_like(w, dtype=self.dtype)
            halves = self._halves = [holder.half_weight for holder, _ in self.half_slots]
        weights = self._half_weights
        if self.copier is not None and self.copier.copies_current(weights, halves):
            return  # the last optimizer step wrote them
        if hasattr(torch, "_foreach_copy_"):  # (no_grad: the parameters themselves are the sources)
            torch._foreach_copy_(halves, weights)
        else:  # pragma: no cover - old torch
            for h, w in zip(halves, weights):
                h.copy_(w)
        if self.copier is not None:
            self.copier.set_half_copies(zip(weights, halves))

    def stage(self, hold_others: bool = False, fresh: bool = False) -> None:
        """Before a training micro-batch's forward. ``fresh``: the optimizer step's only micro-batch
        (no gradients so far): nothing is staged (but a tied embedding's weight: an unfilled buffer), so
        every weight-gradient matmul writes a new float32 gradient (``wgrad_float32(None, ...)``)
        instead of adding into zero-filled buffers, which saves one pass writing zeros over every fused
        weight's gradient and the matmuls' reads of them.
        (Only for a single micro-batch: with several, the first one's graph would differ from the
        others' under torch.compile, which would compile the model twice.)"""
        ws = self._weights
        grads = [w.grad for w in ws]
        if fresh:
            assert all(g is None for g in grads), "fresh: the step's gradients must start empty"
            _UNWRITTEN.clear()
            staged: list[torch.Tensor | None] = [None] * len(ws)
            # except a tied weight's (its two readers need one buffer: the output layer writes it, the
            # embedding adds its rows); a frozen weight gets no gradient
            for _, index in self._companions:
                if staged[index] is None and ws[index].requires_grad:
                    staged[index] = _unfilled(ws[index])
            self._set_main_grads(staged)
            self._hold(hold_others)
            return
        _UNWRITTEN.clear()
        if all(g is None for g in grads):  # the step's first micro-batch: buffers the matmuls write
            grads = [_unfilled(w) for w in ws]
        else:
            empty = [i for i, g in enumerate(grads) if g is None]
            if empty:  # some start from zeros (one multi-tensor fill)
                zeros = [torch.empty_like(ws[i]) for i in empty]
                torch._foreach_zero_(zeros)
                for i, z in zip(empty, zeros):
                    grads[i] = z
            for w in ws:
                w.grad = None
        self._set_main_grads(grads)
        self._hold(hold_others)

    def _hold(self, hold_others: bool) -> None:
        assert not self._held, "merge_held() was not called after the last backward"
        if hold_others:
            self._held = [(p, p.grad) for p in self.others if p.grad is not None]
            for p, _ in self._held:
                p.grad = None

    def release(self) -> None:
        self._set_main_grads(None)

    @torch.no_grad()
    def merge_held(self) -> None:
        """After a micro-batch's backward: add the held gradients to the new ones (one multi-tensor
        addition) and make them the parameters' gradients again."""
        _UNWRITTEN.clear()  # (a weight whose backward did not run keeps no gradient: autograd set none)
        if self._delayed:
            promote_(self._delayed)
        held, self._held = self._held, []
        fresh = [(p.grad, g) for p, g in held if p.grad is not None]
        if fresh:
            torch._foreach_add_([g for _, g in fresh], [new for new, _ in fresh])
        for p, g in held:
            p.grad = g

    def drop_half_weights(self) -> None:
        """Free the half-precision and fp8 copies (they come back with the next ``refresh``)."""
        for holder, _ in self.half_slots:
            holder.half_weight = None
        for m in self.fp8_linears:
            m.drop_fp8()
        for holder, _ in self._fp8_holders:
            holder.fp8_weights.drop()
        self._halves = None
        if self.copier is not None:
            self.copier.set_half_copies(())
