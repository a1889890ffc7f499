"""fp8 matmuls on the gradient-accumulation fusion's protocol (``--fp8-format`` where the fusion
applies: one process or replicated data parallel, no TP, PP, FSDP2 or full recomputation).

The recipe is the one :mod:`megatrain.runtime.fp8` gets from torchao (e4m3 forward operands, e5m2
or e4m3 output gradients, a dynamic per-tensor scale from each tensor's current absolute maximum,
``torch._scaled_mm`` with fast accumulation in the forward only), so the numbers are the same
(``--fp8-recipe delayed`` instead scales the inputs and output gradients from amax histories of
earlier micro-batches: :mod:`megatrain.runtime.fp8_scaling`); what differs is what happens to the
weights and their gradients:

* torchao's ``Float8Linear`` casts every float32 weight to fp8 in each micro-batch's forward and
  again, in the other layout, in its backward (an absolute-maximum pass and a cast pass each), and
  its weight-gradient matmul writes a bf16 gradient that autograd casts to float32 and adds to
  ``.grad``: about 38 bytes moved per weight and micro-batch besides the matmuls.
* :class:`Fp8FusedLinear` casts each weight once per optimizer step, in
  :meth:`GradAccumulationFusion.refresh <megatrain.runtime.grad_accumulation_fusion.GradAccumulationFusion.refresh>`
  (the weights do not change between micro-batches): the fp8 weight in both layouts the matmuls
  take and its inverse scale, written in place (so captured CUDA graphs see the new values). The
  weight-gradient matmul writes float32 (more exact than bf16) into the staged gradient on a step's
  first micro-batch and adds into it from the second on (``megatrain::fp8_accumulate_wgrad_``); a
  step of one micro-batch writes it as the new ``.grad``. The forward saves the fp8 input (one byte an
  element, not two) with its scale for the backward.

Token counts that are not a multiple of 16 (the fp8 kernels' inner sizes) get zero rows appended
for the matmuls, which change no sum. ``torch._scaled_mm`` runs on CUDA (sm89 and later) and, in
recent torch, on the CPU, where the tests check these layers against the same maths in float32.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.runtime.fp8_scaling import Fp8Recipe, cast_delayed, new_state
from megatrain.runtime.grad_accumulation_fusion import take_unwritten

__all__ = ["Fp8FusedLinear", "convert_fp8_linears", "fits_fp8_matmuls", "fp8_accumulate_wgrad_", "quantize",
           "weight_grad"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_EPS = 1e-12  # the smallest absolute maximum a scale is computed from (an all-zero tensor)
_INNER = 16  # the fp8 matmul kernels' inner sizes are multiples of this


def grad_dtype_of(fmt: str) -> torch.dtype:
    """The output gradients' fp8 dtype of ``--fp8-format`` (hybrid: e5m2; e4m3: e4m3)."""
    return E5M2 if fmt == "hybrid" else E4M3


def quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in fp8 ``dtype`` with a per-tensor scale (the format's largest value over ``t``'s
    absolute maximum, computed in float64 so eager and compiled code agree), and the inverse scale
    (float32, 0-d) that ``torch._scaled_mm`` multiplies the product by."""
    amax = t.abs().amax().to(torch.float64)
    fmax = torch.finfo(dtype).max
    scale = (fmax / amax.clamp(min=_EPS)).to(torch.float32)
    t8 = (t.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype)
    return t8, scale.reciprocal()


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[0] % _INNER
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def _cast_weight_(weight: torch.Tensor, w8: torch.Tensor, w8_t: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Write ``weight``'s fp8 copy (row-major, the forward's operand), its transpose (row-major,
    the input gradient's) and the inverse scale into the given buffers."""
    t8, inv = quantize(weight, E4M3)
    w8.copy_(t8)
    w8_t.copy_(t8.t())
    inv_scale.copy_(inv)


_COMPILED_CAST: list[Any] = []


def _weight_caster(device: torch.device, compiled: bool) -> Any:
    """:func:`_cast_weight_` compiled on CUDA when ``compiled`` (one reduction and one pass writing both
    layouts), eager otherwise."""
    if device.type != "cuda" or not compiled:
        return _cast_weight_
    if not _COMPILED_CAST:
        _COMPILED_CAST.append(torch.compile(_cast_weight_, dynamic=False))
    return _COMPILED_CAST[0]


def cast_weight_copies(weight: torch.Tensor, copies: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                       compiled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` cast to fp8 into ``copies`` (its row-major fp8 copy, the transpose, the inverse scale),
    allocated on ``weight``'s device where None or elsewhere; the copies, written in place."""
    if copies is None or copies[0].device != weight.device:
        copies = (torch.empty_like(weight, dtype=E4M3),
                  torch.empty(weight.shape[1], weight.shape[0], dtype=E4M3, device=weight.device),
                  torch.empty((), dtype=torch.float32, device=weight.device))
    _weight_caster(weight.device, compiled)(weight, *copies)
    return copies


def _wgrad(grad_t: torch.Tensor, inp_t: torch.Tensor, grad_inv: torch.Tensor, inp_inv: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight gradient dY^T x in float32 from row-major fp8 ``grad_t`` [out, tokens] and ``inp_t``
    [in, tokens] (the layouts the kernel takes are made here, so a compiler's choice of strides for
    the arguments cannot matter), into ``out`` when given."""
    return torch._scaled_mm(grad_t.contiguous(), inp_t.contiguous().t(), grad_inv, inp_inv,
                            out_dtype=torch.float32, **({} if out is None else {"out": out}))


def _accumulate(main_grad: torch.Tensor, grad_t: torch.Tensor, inp_t: torch.Tensor, grad_inv: torch.Tensor,
                inp_inv: torch.Tensor) -> None:
    if take_unwritten(main_grad):  # the step's first micro-batch: the product written in place
        _wgrad(grad_t, inp_t, grad_inv, inp_inv, out=main_grad)
    else:
        main_grad.add_(_wgrad(grad_t, inp_t, grad_inv, inp_inv))


# Registered on the dispatcher as the fusion's bf16 operators are (no autograd formula: it runs
# inside backward passes); opaque to the compiler, which would otherwise see a mutation of a saved input.
_LIB = torch.library.Library("megatrain", "FRAGMENT")
_LIB.define("fp8_accumulate_wgrad_(Tensor(a!) main_grad, Tensor grad_t, Tensor inp_t, Tensor grad_inv, "
            "Tensor inp_inv) -> ()")
_LIB.impl("fp8_accumulate_wgrad_", _accumulate, "CompositeExplicitAutograd")


@torch.library.register_fake("megatrain::fp8_accumulate_wgrad_", lib=_LIB)
def _(main_grad: torch.Tensor, grad_t: torch.Tensor, inp_t: torch.Tensor, grad_inv: torch.Tensor,
      inp_inv: torch.Tensor) -> None:
    return None


fp8_accumulate_wgrad_ = torch.ops.megatrain.fp8_accumulate_wgrad_.default


def weight_grad(prev: torch.Tensor | None, grad_t: torch.Tensor, inp_t: torch.Tensor, grad_inv: torch.Tensor,
                inp_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight gradient dY^T x from the transposed fp8 operands: added into the staged float32
    gradient ``prev`` (the gradient-accumulation fusion) and returned as it, or, without one, a new
    tensor in ``dtype``."""
    if prev is None:
        return _wgrad(grad_t, inp_t, grad_inv, inp_inv).to(dtype)
    fp8_accumulate_wgrad_(prev, grad_t, inp_t, grad_inv, inp_inv)
    return prev


def fits_fp8_matmuls(*sizes: int) -> bool:
    """Whether the fp8 matmul kernels take these sizes (multiples of 16)."""
    return all(n % _INNER == 0 for n in sizes)


class _Fp8LinearFn(torch.autograd.Function):
    """y = x @ w^T in fp8 (+ bias); weight's gradient = prev + dY^T x in float32 (fp8 operands).
    ``delayed``: None (each cast scaled from its tensor's own amax) or (margin, use_max, record) with
    the fp8 input and its inverse scale cast by the caller, and the output gradient's scale and amax
    state for :func:`~megatrain.runtime.fp8_scaling.cast_delayed` in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, w8: torch.Tensor, w8_t: torch.Tensor,
                w_inv: torch.Tensor, bias: torch.Tensor | None, prev: torch.Tensor | None,
                dtype: torch.dtype, grad_dtype: torch.dtype, delayed: tuple[int, bool, bool] | None = None,
                x8: torch.Tensor | None = None, x_inv: torch.Tensor | None = None,
                grad_scale: torch.Tensor | None = None, grad_state: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if delayed is None:
            x8, x_inv = quantize(_pad_rows(x.reshape(rows, x.shape[-1]).to(dtype)), E4M3)
        assert x8 is not None and x_inv is not None, "delayed scaling: the caller casts the input"
        y = torch._scaled_mm(x8, w8.t(), x_inv, w_inv, out_dtype=dtype, use_fast_accum=True)[:rows]
        if bias is not None:
            y = y + bias.to(dtype)
        ctx.save_for_backward(x8, x_inv, w8_t, w_inv, prev, grad_scale, grad_state)
        ctx.meta = (x.dtype, x.shape, weight.dtype, None if bias is None else bias.dtype, dtype, grad_dtype, delayed)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        x8, x_inv, w8_t, w_inv, prev, grad_scale, grad_state = ctx.saved_tensors
        x_dtype, x_shape, w_dtype, b_dtype, dtype, grad_dtype, delayed = ctx.meta
        rows = grad_y.numel() // grad_y.shape[-1]
        g2 = _pad_rows(grad_y.reshape(rows, grad_y.shape[-1]).to(dtype))
        if delayed is None:
            g8, g_inv = quantize(g2, grad_dtype)
        else:
            g8, g_inv = cast_delayed(g2, grad_dtype, grad_scale, grad_state, *delayed)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._scaled_mm(g8, w8_t.t(), g_inv, w_inv, out_dtype=dtype)[:rows]
            grad_x = grad_x.view(x_shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(prev, g8.t().contiguous(), x8.t().contiguous(), g_inv, x_inv, w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[5]:
            grad_b = g2.sum(0, dtype=torch.float32).to(b_dtype)
        return grad_x, grad_w, None, None, None, grad_b, None, None, None, None, None, None, None, None


class Fp8FusedLinear(nn.Linear):
    """``nn.Linear`` whose matmuls run in fp8 from weight copies cast once per optimizer step (see
    the module doc); made by :func:`convert_fp8_linears`. Before the first :meth:`refresh_fp8` it
    computes as a plain ``nn.Linear``."""

    fp8_weight: torch.Tensor | None
    fp8_weight_t: torch.Tensor | None
    fp8_inv_scale: torch.Tensor | None
    main_grad_in: torch.Tensor | None
    compute_dtype: torch.dtype
    grad_dtype: torch.dtype
    compile_cast: bool  # the once-a-step weight cast compiled on CUDA (off with --no-torch-compile)
    recipe: Fp8Recipe
    # delayed scaling (megatrain.runtime.fp8_scaling), for the inputs and the output gradients: the
    # scale their casts use, and [the next scale, the amax history] (float32; None with tensorwise)
    scale_in: torch.Tensor | None
    amax_state_in: torch.Tensor | None
    scale_grad: torch.Tensor | None
    amax_state_grad: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_weight is None:
            return F.linear(x, self.weight, self.bias)
        if not self.recipe.delayed:
            return _Fp8LinearFn.apply(x, self.weight, self.fp8_weight, self.fp8_weight_t, self.fp8_inv_scale,
                                      self.bias, self.main_grad_in, self.compute_dtype, self.grad_dtype, None)
        # amaxes are recorded by training passes only (evaluation casts with the scales as they are)
        delayed = (self.recipe.margin, self.recipe.use_max, torch.is_grad_enabled())
        x2 = _pad_rows(x.detach().reshape(-1, x.shape[-1]).to(self.compute_dtype))
        x8, x_inv = cast_delayed(x2, E4M3, self.scale_in, self.amax_state_in, *delayed)
        return _Fp8LinearFn.apply(x, self.weight, self.fp8_weight, self.fp8_weight_t, self.fp8_inv_scale,
                                  self.bias, self.main_grad_in, self.compute_dtype, self.grad_dtype, delayed,
                                  x8, x_inv, self.scale_grad, self.amax_state_grad)

    @torch.no_grad()
    def refresh_fp8(self) -> None:
        """Cast the weight to fp8 (both layouts) into this module's buffers, allocated on first use."""
        w = self.weight
        held = None if self.fp8_weight is None else (self.fp8_weight, self.fp8_weight_t, self.fp8_inv_scale)
        self.fp8_weight, self.fp8_weight_t, self.fp8_inv_scale = cast_weight_copies(w, held, self.compile_cast)
        if self.scale_in is not None and self.scale_in.device != w.device:  # the model moved
            for name in ("scale_in", "amax_state_in", "scale_grad", "amax_state_grad"):
                setattr(self, name, getattr(self, name).to(w.device))

    def drop_fp8(self) -> None:
        self.fp8_weight = self.fp8_weight_t = self.fp8_inv_scale = None


def convert_fp8_linears(modules: Iterable[nn.Module], fmt: str, dtype: torch.dtype,
                        compile_cast: bool = True, recipe: Fp8Recipe | None = None) -> list[Fp8FusedLinear]:
    """Turn each of ``modules`` (plain ``nn.Linear`` layers the caller found eligible) into an
    :class:`Fp8FusedLinear` computing in ``dtype`` with ``--fp8-format`` ``fmt``'s gradient dtype and
    ``recipe``'s scaling (default tensorwise), in place; ``compile_cast``: compile the weights' cast
    on CUDA. Delayed scaling's state starts on the weights' device."""
    out = []
    for m in modules:
        assert type(m) is nn.Linear, f"not a plain nn.Linear: {type(m).__name__}"
        m.__class__ = Fp8FusedLinear
        m.fp8_weight = m.fp8_weight_t = m.fp8_inv_scale = m.main_grad_in = None
        m.scale_in = m.amax_state_in = m.scale_grad = m.amax_state_grad = None
        m.compute_dtype, m.grad_dtype, m.compile_cast = dtype, grad_dtype_of(fmt), compile_cast
        m.recipe = recipe or Fp8Recipe()
        if m.recipe.delayed:
            m.scale_in, m.amax_state_in = new_state(m.recipe, m.weight.device)
            m.scale_grad, m.amax_state_grad = new_state(m.recipe, m.weight.device)
        out.append(m)
    return out
