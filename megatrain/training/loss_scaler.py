"""fp16 loss scaling with Megatron-LM's semantics, and the inf/nan checks on gradients.

Megatron's choice of scaler: ``--loss-scale S`` gives :class:`ConstantLossScaler`;
``--fp16`` without it gives :class:`DynamicLossScaler` (``--initial-loss-scale``,
``--min-loss-scale``, ``--loss-scale-window``, ``--hysteresis``, growth 2, backoff 0.5);
bf16 and fp32 runs use no scaler and log ``loss scale: 1.0``.

A step with a scaler::

    (loss * scaler.scale).backward()
    found_inf = unscale_grads_(params, 1.0 / scaler.scale)   # no host sync
    reduce_found_inf(found_inf)                               # MAX over all ranks
    found = bool(found_inf.item())                            # the one sync
    scaler.update(found)
    if not found: optimizer.step()   # else: skip the step and the LR schedule advance

The scale is kept on the host as a float rounded to float32, as Megatron's fp32
scale tensor is, so loss-scale values in logs and checkpoints agree.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Mapping

import numpy as np
import torch


def _f32(x: float) -> float:
    """Round to the nearest float32 (Megatron keeps the scale in an fp32 tensor)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _as_float(x: Any) -> float:
    if isinstance(x, torch.Tensor):
        return float(x.detach().reshape(-1)[0].item())
    return float(x)


class _LossScaler:
    """What every scaler exposes: the current scale (an fp32-rounded float) and its inverse."""

    _scale: float

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self._scale


class ConstantLossScaler(_LossScaler):
    """A fixed loss scale (``--loss-scale``); overflowing steps are still skipped."""

    def __init__(self, scale: float) -> None:
        if not scale > 0.0:
            raise ValueError(f"--loss-scale must be positive, got {scale}")
        self._scale = _f32(scale)

    def update(self, found_inf: bool) -> None:
        """Nothing changes: the scale is constant."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Nothing to restore (Megatron stores nothing for a constant scale)."""


class DynamicLossScaler(_LossScaler):
    """Megatron's DynamicGradScaler.

    * An overflow resets the growth tracker and uses up one unit of hysteresis; once
      the hysteresis is used up (tracker <= 0), this and every further overflow multiply
      the scale by ``backoff_factor``, never below ``min_scale``.
    * A clean step increments the growth tracker; after ``growth_interval`` clean steps
      in a row the scale is multiplied by ``growth_factor`` and both trackers reset.
      Clean steps do not restore hysteresis on their own: only growth does.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        if not initial_scale > 0.0:
            raise ValueError(f"--initial-loss-scale must be positive, got {initial_scale}")
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(f"--min-loss-scale must be in (0, --initial-loss-scale={initial_scale}], got {min_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"loss-scale growth factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"loss-scale backoff factor must be in (0, 1), got {backoff_factor}")
        if growth_interval <= 0:
            raise ValueError(f"--loss-scale-window must be positive, got {growth_interval}")
        if hysteresis <= 0:
            raise ValueError(f"--hysteresis must be positive, got {hysteresis}")
        self._scale = _f32(initial_scale)
        self.min_scale = _f32(min_scale)
        self.growth_factor = _f32(growth_factor)
        self.backoff_factor = _f32(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    @property
    def growth_tracker(self) -> int:
        return self._growth_tracker

    @property
    def hysteresis_tracker(self) -> int:
        return self._hysteresis_tracker

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step; ``found_inf`` must already agree on all ranks."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(_f32(self._scale * self.backoff_factor), self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = _f32(self._scale * self.growth_factor)

    def state_dict(self) -> dict:
        """Plain data with Megatron's keys (``scale`` a float rather than a tensor)."""
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Accepts this class's state or a Megatron one (whose ``scale`` is a tensor)."""
        self._scale = _f32(_as_float(state_dict["scale"]))
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])


LossScaler = ConstantLossScaler | DynamicLossScaler


def build_loss_scaler(
    *,
    fp16: bool,
    loss_scale: float | None = None,
    initial_loss_scale: float = 2.0**32,
    min_loss_scale: float = 1.0,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
) -> LossScaler | None:
    """Megatron's rule: ``--loss-scale`` -> constant; else fp16 -> dynamic; else none."""
    if loss_scale:
        return ConstantLossScaler(loss_scale)
    if fp16:
        return DynamicLossScaler(
            initial_scale=initial_loss_scale,
            min_scale=min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=loss_scale_window,
            hysteresis=hysteresis,
        )
    return None


# -- gradient checks ----------------------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _grads_by_device_dtype(params: Iterable[torch.nn.Parameter | torch.Tensor]) -> dict:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        if g is None:
            continue
        g = _local(g)
        if g.numel() == 0:
            continue
        groups[(g.device, g.dtype)].append(g)
    return groups


def _default_device(params: list) -> torch.device:
    return _local(params[0]).device if params else torch.device("cpu")


def _non_finite_check_and_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor,
                                   inv_scale: torch.Tensor) -> None:
    fused = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if fused is not None:
        try:
            fused(grads, found_inf, inv_scale)
            return
        except (RuntimeError, NotImplementedError):  # e.g. a device without the kernel
            pass
    flags = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any()
    found_inf.copy_(torch.maximum(found_inf, flags.to(found_inf.dtype)))
    torch._foreach_mul_(grads, inv_scale)


def unscale_grads_(params: Iterable[torch.nn.Parameter | torch.Tensor], inv_scale: float | torch.Tensor
                   ) -> torch.Tensor:
    """Multiply every gradient by ``inv_scale`` in place; return found_inf (0-dim float32).

    found_inf is 1.0 when any gradient held inf or nan (before unscaling) on this rank,
    on the device of the first gradient. Nothing here waits for the device. DTensor
    gradients are checked and scaled on their local shards, so the caller must reduce
    found_inf over every rank that holds a shard (:func:`reduce_found_inf`).
    """
    params = list(params)
    groups = _grads_by_device_dtype(params)
    first_device = next(iter(groups))[0] if groups else _default_device(params)
    found_inf = torch.zeros((), dtype=torch.float32, device=first_device)
    for (device, _dtype), grads in groups.items():
        found_here = torch.zeros((), dtype=torch.float32, device=device)
        if isinstance(inv_scale, torch.Tensor):
            inv = inv_scale.detach().to(device=device, dtype=torch.float32).reshape(())
        else:
            inv = torch.full((), float(inv_scale), dtype=torch.float32, device=device)
        _non_finite_check_and_unscale_(grads, found_here, inv)
        found_inf = torch.maximum(found_inf, found_here.to(first_device, non_blocking=True))
    return found_inf


def found_inf_in_grads(params: Iterable[torch.nn.Parameter | torch.Tensor]) -> torch.Tensor:
    """0-dim float32 tensor, 1.0 when any gradient on this rank holds inf or nan; no host sync.

    Gradients are not changed. Reduce with :func:`reduce_found_inf` before deciding.
    """
    params = list(params)
    groups = _grads_by_device_dtype(params)
    first_device = next(iter(groups))[0] if groups else _default_device(params)
    found_inf = torch.zeros((), dtype=torch.float32, device=first_device)
    for (device, _dtype), grads in groups.items():
        # An L2 norm accumulated in fp32 is inf/nan exactly when some element is
        # (nan and inf propagate through sums; fp16/bf16 squares cannot overflow fp32).
        try:
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        except TypeError:  # older signature without dtype
            norms = [n.float() for n in torch._foreach_norm(grads, 2.0)]
        bad = (~torch.isfinite(torch.stack(list(norms)))).any().float()
        found_inf = torch.maximum(found_inf, bad.to(first_device, non_blocking=True))
    return found_inf


def reduce_found_inf(found_inf: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-reduce ``found_inf`` with MAX over ``group`` (default: all ranks), in place.

    A no-op when torch.distributed is unavailable or not initialised.
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf
