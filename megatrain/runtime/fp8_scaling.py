"""Delayed fp8 scaling (``--fp8-recipe delayed``, Megatron's default recipe) for megatrain's fp8
layers (:mod:`megatrain.runtime.fp8_fusion`).

Dynamic (tensorwise) scaling reads a whole tensor for its absolute maximum before its cast can
start: two passes over every fp8 layer's input and output gradient. Delayed scaling casts with a
scale decided before the tensor exists, from the absolute maxima (amaxes) of earlier micro-batches,
and records the current amax in the same pass as the cast, as Transformer Engine's
``DelayedScaling`` recipe does:

* each fp8 layer keeps, for its input and for its output gradient, an amax history of
  ``--fp8-amax-history-len`` entries (the newest first) and the scale the next cast uses;
* a cast multiplies by that scale; then the tensor's amax enters the history and the next scale
  becomes ``fp8_max / amax / 2**margin``, amax being the history's newest entry
  (``--fp8-amax-compute-algo most_recent``) or its maximum (``max``); where that amax is zero or not
  finite, the scale stays;
* scales start at 1.0 (Transformer Engine's start: the first micro-batch's casts use it);
* evaluation forwards cast with the current scales and record nothing.

What differs from Transformer Engine: the weights keep an exact scale (each is cast once per
optimizer step from its own current amax: what a history would estimate), and data-parallel
replicas combine their histories once per optimizer step (elementwise maximum, one all-reduce;
:func:`sync_`) instead of after every micro-batch, which keeps the replicas' scales equal at every
step boundary, so a checkpoint holds one copy (:func:`state_of` / :func:`load_state_`) and a
resumed run continues exactly.

The new history and next scale are computed in traced code beside the cast (so a compiled model
can reduce the amax in the pass that casts) and written by ``megatrain::fp8_scaling_store_``, an
operator opaque to the compiler (it also runs inside backward passes, where a compiled graph must
not see a mutated saved input), into a state the cast does not read; :func:`promote_` makes the
next scales current after each micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import torch

__all__ = ["Fp8Recipe", "cast_delayed", "load_state_", "new_state", "promote_", "state_of", "sync_"]


@dataclass(frozen=True)
class Fp8Recipe:
    """``--fp8-recipe`` and delayed scaling's settings (``--fp8-margin``, ``--fp8-amax-history-len``,
    ``--fp8-amax-compute-algo``)."""

    delayed: bool = False
    margin: int = 0
    history_len: int = 1
    amax_compute_algo: str = "most_recent"

    def __post_init__(self) -> None:
        if self.history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be >= 1, got {self.history_len}")
        if self.margin < 0:
            raise ValueError(f"--fp8-margin must be >= 0, got {self.margin}")
        if self.amax_compute_algo not in ("most_recent", "max"):
            raise ValueError(f"--fp8-amax-compute-algo must be most_recent or max, got {self.amax_compute_algo!r}")

    @property
    def use_max(self) -> bool:
        return self.amax_compute_algo == "max"

    def describe(self) -> str:
        if not self.delayed:
            return "tensorwise scaling"
        return (f"delayed scaling (amax history {self.history_len}, {self.amax_compute_algo}, "
                f"margin {self.margin})")


def new_state(recipe: Fp8Recipe, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor's (scale, amax state) at the start: 1.0, and [next scale 1.0, zero history]."""
    state = torch.zeros(1 + recipe.history_len, dtype=torch.float32, device=device)
    state[0] = 1.0
    return torch.ones((), dtype=torch.float32, device=device), state


def _store(state: torch.Tensor, new_state: torch.Tensor) -> None:
    state.copy_(new_state)


# The state a cast records into is never the scale it reads: inductor computes a lazily evaluated
# read of a tensor (the cast, for each consumer) after an opaque operator that updated it in place.
_LIB = torch.library.Library("megatrain", "FRAGMENT")
_LIB.define("fp8_scaling_store_(Tensor(a!) state, Tensor new_state) -> ()")
_LIB.impl("fp8_scaling_store_", _store, "CompositeExplicitAutograd")


@torch.library.register_fake("megatrain::fp8_scaling_store_", lib=_LIB)
def _(state: torch.Tensor, new_state: torch.Tensor) -> None:
    return None


fp8_scaling_store_ = torch.ops.megatrain.fp8_scaling_store_.default
_FP32_MAX = torch.finfo(torch.float32).max


def _next_scale(amax: torch.Tensor, scale: torch.Tensor, fmax: float | torch.Tensor, margin: int) -> torch.Tensor:
    """The scale from ``amax``, or ``scale`` where ``amax`` is zero or not finite. The division is
    float64's (so eager and compiled code agree), which rounded to float32 is float32's correctly
    rounded quotient, Transformer Engine's; a quotient beyond float32 (a subnormal amax) is float32's
    largest value."""
    amax64 = amax.to(torch.float64)
    # a tensor numerator: `number / tensor` would be the tensor's reciprocal times the number (two roundings)
    fresh = (torch.full_like(amax64, 1.0) * (fmax / 2.0 ** margin) / amax64).clamp(max=_FP32_MAX).to(torch.float32)
    return torch.where((amax > 0) & torch.isfinite(amax), fresh, scale)


def cast_delayed(t: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor, state: torch.Tensor,
                 margin: int, use_max: bool, record: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in fp8 ``dtype`` cast with ``scale`` (saturating), and the inverse scale (a new 0-d
    float32 tensor) ``torch._scaled_mm`` multiplies by. With ``record``, ``t``'s amax enters the
    history in ``state`` ([next scale, history newest first], in place) and the next scale is
    computed there (``use_max``: from the history's maximum, else from this amax); :func:`promote_`
    makes it the scale before the next micro-batch."""
    fmax = torch.finfo(dtype).max
    t8 = (t.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype)
    inv = scale.reciprocal()
    if record:
        amax = t.abs().amax().to(torch.float32).view(1)
        history = torch.cat([amax, state[1:-1]])
        newest = history.amax() if use_max else amax[0]
        fp8_scaling_store_(state, torch.cat([_next_scale(newest, scale, fmax, margin).view(1), history]))
    return t8, inv


# ---- the whole model's state: data-parallel agreement and checkpoints ----------------------------

def _slots(layers: Iterable[Any]) -> list[tuple[torch.Tensor, torch.Tensor, torch.dtype]]:
    """Every (scale, amax state, fp8 dtype) of ``layers`` (their inputs', then output gradients')."""
    out = []
    for m in layers:
        out.append((m.scale_in, m.amax_state_in, torch.float8_e4m3fn))
        out.append((m.scale_grad, m.amax_state_grad, m.grad_dtype))
    return out


@torch.no_grad()
def promote_(layers: list[Any]) -> None:
    """Make the scales recorded by the last micro-batch the ones the casts use (one multi-tensor copy;
    the gradient-accumulation fusion calls it after each training micro-batch's backward)."""
    slots = _slots(layers)
    if slots:
        torch._foreach_copy_([s for s, _, _ in slots], [st[0] for _, st, _ in slots])


@torch.no_grad()
def sync_(layers: list[Any], recipe: Fp8Recipe, group: Any) -> None:
    """Make every data-parallel replica's histories their elementwise maximum and recompute the
    scales from them (where a history has no usable amax, the replicas' smallest scale): one
    all-reduce over ``group``, so every replica leaves the optimizer step with the same state."""
    promote_(layers)
    slots = _slots(layers)
    if not slots:
        return
    histories = torch.stack([st[1:] for _, st, _ in slots])
    scales = torch.stack([s for s, _, _ in slots])
    packed = torch.cat([histories.flatten(), -scales])
    torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.MAX, group=group)
    histories = packed[:histories.numel()].view_as(histories)
    smallest = -packed[histories.numel():]
    amax = histories.amax(1) if recipe.use_max else histories[:, 0]
    fmax = torch.tensor([torch.finfo(d).max for _, _, d in slots], dtype=torch.float64, device=amax.device)
    new_scales = _next_scale(amax, smallest, fmax, recipe.margin)
    states = torch.cat([new_scales[:, None], histories], 1)
    torch._foreach_copy_([s for s, _, _ in slots], list(new_scales.unbind(0)))
    torch._foreach_copy_([st for _, st, _ in slots], list(states.unbind(0)))


def state_of(layers: list[Any], names: list[str], recipe: Fp8Recipe) -> dict[str, Any]:
    """The scales and histories as plain data for a checkpoint's meta.json (Python floats hold
    float32 values exactly): ``{"recipe", "layers": {name: {"input": [scale, history...],
    "grad": [...]}}}``, each scale the one the next cast would use."""
    promote_(layers)

    def row(state: torch.Tensor) -> list[float]:
        return state.tolist()
    return {"recipe": asdict(recipe),
            "layers": {name: {"input": row(m.amax_state_in), "grad": row(m.amax_state_grad)}
                       for name, m in zip(names, layers)}}


def _valid_row(row: Any) -> bool:
    """[a finite scale > 0, amaxes...]: plain numbers; an amax is >= 0, or inf or NaN as a run with
    overflowing activations records them (such an entry leaves the scale as it is)."""
    if not isinstance(row, list) or len(row) < 2:
        return False
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row):
        return False
    return math.isfinite(row[0]) and row[0] > 0 and not any(v < 0 for v in row[1:])


@torch.no_grad()
def load_state_(layers: list[Any], names: list[str], recipe: Fp8Recipe, state: dict[str, Any]) -> list[str]:
    """Restore what :func:`state_of` saved into ``layers`` (named ``names``); notes on what differs.
    A history saved with another length keeps its newest entries (zeros after them); layers the
    checkpoint lacks keep their start (scale 1.0). Malformed data raises ValueError."""
    notes = []
    saved = state.get("layers")
    if not isinstance(saved, dict):
        raise ValueError("fp8_scaling: no layers")
    saved_len = (state.get("recipe") or {}).get("history_len")
    if saved_len != recipe.history_len:
        notes.append(f"note: the checkpoint's fp8 amax histories hold {saved_len} entries, --fp8-amax-history-len "
                     f"is {recipe.history_len}: the newest {min(saved_len or 0, recipe.history_len)} carry over")
    missing = [n for n in names if n not in saved]
    if missing:
        notes.append(f"note: the checkpoint has no fp8 scales for {len(missing)} fp8 layers (e.g. {missing[0]}): "
                     "they start at scale 1.0")
    for name, m in zip(names, layers):
        if name not in saved:
            continue
        for key, scale, st in (("input", m.scale_in, m.amax_state_in), ("grad", m.scale_grad, m.amax_state_grad)):
            row = saved[name].get(key) if isinstance(saved[name], dict) else None
            if not _valid_row(row):
                raise ValueError(f"fp8_scaling: layer {name}: malformed {key!r} entry (a positive finite scale, "
                                 "then non-negative amaxes, expected)")
            values = torch.tensor(row[:1 + recipe.history_len], dtype=torch.float32)
            st.zero_()
            st[:values.numel()].copy_(values)
            scale.fill_(row[0])
    return notes
