"""Gradient norms and clipping over plain tensors and DTensors, and across process groups.

:func:`get_grad_norm` measures the global norm of all gradients (DTensor gradients through
DTensor, so sharded and replicated parameters count once; ``reduce_group`` combines the norms of
ranks that hold different parameters, e.g. pipeline stages), :func:`get_total_norm` that of any
tensors (the parameters: ``--log-params-norm``), :func:`count_zeros` the gradients' zeros;
:func:`clip_grads_with_norm_` scales them by Megatron's coefficient; :func:`clip_grad_norm_` does
both. Nothing here syncs with the host. They live in ``parallel/`` because the pipeline's norm over
stages needs them and ``parallel/`` imports nothing from ``training/``; ``megatrain.optimizer``
re-exports them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable

import torch

__all__ = ["get_grad_norm", "get_total_norm", "count_zeros", "scale_grads_", "clip_coefficient", "clip_divisor",
           "clip_grads_with_norm_", "clip_grad_norm_"]


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _default_device() -> torch.device:
    """Where a rank with nothing to measure puts its 0 (the collectives after it need the run's device)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _plain_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Norm over plain tensors, accumulated in fp32, on the first tensor's device."""
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_device[g.device].append(g)
    out_device = grads[0].device
    norms = []
    for device_grads in by_device.values():
        try:
            per_tensor = torch._foreach_norm(device_grads, norm_type, dtype=torch.float32)
        except (TypeError, RuntimeError):
            per_tensor = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in device_grads]
        norms.extend(n.to(out_device) for n in per_tensor)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _dtensor_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Norm over DTensors of one mesh; sharded parts are combined across their ranks."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        total = get_total_norm(grads, norm_type)
    else:
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]),
                                         norm_type)
    return total.full_tensor() if _is_dtensor(total) else total


def _combine(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    device = norms[0].device
    stacked = torch.stack([n.to(device) for n in norms])
    return torch.linalg.vector_norm(stacked, norm_type)


def get_grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0, *, reduce_group: Any = None
                  ) -> torch.Tensor:
    """Total ``norm_type`` norm of all gradients as a 0-dim float32 tensor (no host sync).

    DTensor gradients are grouped by mesh and reduced through DTensor; plain
    tensors are taken as they are. ``reduce_group``: a process group whose ranks
    hold different parameters (e.g. pipeline stages) to combine the norm over.
    """
    return get_total_norm([p.grad for p in params if p.grad is not None], norm_type, reduce_group=reduce_group)


def count_zeros(params: Iterable[torch.Tensor], *, reduce_group: Any = None) -> torch.Tensor:
    """How many gradient elements are exactly zero (Megatron's ``--log-num-zeros-in-grad``), as a 0-dim
    int64 tensor: DTensor gradients counted through DTensor (each element once, however it is sharded or
    replicated), ``reduce_group`` summing the counts of ranks that hold different parameters."""
    counts = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        zeros = (g == 0).sum()
        counts.append(zeros.full_tensor() if _is_dtensor(zeros) else zeros)
    if counts:
        device = counts[0].device
        total = torch.stack([c.to(device=device, dtype=torch.int64) for c in counts]).sum()
    else:
        total = torch.zeros((), dtype=torch.int64, device=_default_device())
    dist = torch.distributed
    if reduce_group is not None and dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=reduce_group)
    return total


def get_total_norm(tensors: Iterable[torch.Tensor], norm_type: float = 2.0, *, reduce_group: Any = None
                   ) -> torch.Tensor:
    """Total ``norm_type`` norm of ``tensors`` (gradients, or the parameters themselves: Megatron's
    ``--log-params-norm``) as a 0-dim float32 tensor, as :func:`get_grad_norm` measures gradients."""
    norm_type = float(norm_type)
    plain: list[torch.Tensor] = []
    by_mesh: dict[int, list[torch.Tensor]] = defaultdict(list)
    for g in tensors:
        g = g.detach()
        (by_mesh[id(g.device_mesh)] if _is_dtensor(g) else plain).append(g)
    parts = [_dtensor_norm(gs, norm_type) for gs in by_mesh.values()]
    if plain:
        parts.append(_plain_norm(plain, norm_type))
    if parts:
        total = _combine(parts, norm_type).float()
    else:
        total = torch.zeros((), dtype=torch.float32, device=_default_device())
    dist = torch.distributed
    if reduce_group is not None and dist.is_available() and dist.is_initialized():
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=reduce_group)
        else:
            powered = total.pow(norm_type)
            dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=reduce_group)
            total = powered.pow(1.0 / norm_type)
    return total


def scale_grads_(params: Iterable[torch.Tensor], factor: torch.Tensor, *, foreach: bool | None = None) -> None:
    """Multiply every gradient by the 0-dim tensor ``factor`` in place (no host synchronisation).

    DTensor gradients are scaled through their local shards.
    """
    by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            g = _local(p.grad)
            by_key[(g.device, g.dtype)].append(g)
    for (device, _dtype), grads in by_key.items():
        c = factor.to(device)
        if foreach is False:
            for g in grads:
                g.mul_(c)
        else:
            torch._foreach_mul_(grads, c)


def clip_grads_with_norm_(params: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor,
                          *, foreach: bool | None = None) -> None:
    """Scale gradients by ``min(1, max_norm / (total_norm + 1e-6))`` in place (Megatron's coefficient).

    DTensor gradients are scaled through their local shards.
    """
    scale_grads_(params, clip_coefficient(max_norm, total_norm), foreach=foreach)


def clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """Megatron's clipping factor ``min(1, max_norm / (total_norm + 1e-6))`` as a 0-dim fp32 tensor."""
    return torch.clamp(max_norm / (total_norm.float() + 1.0e-6), max=1.0)


def clip_divisor(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """What clipping divides the gradients by: ``max(1, (total_norm + 1e-6) / max_norm)``, the inverse
    of :func:`clip_coefficient` (for a fused optimizer step that divides as it reads them)."""
    return torch.clamp((total_norm.float() + 1.0e-6) / max_norm, min=1.0)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *,
                    foreach: bool | None = None, reduce_group: Any = None) -> torch.Tensor:
    """Clip gradients to ``max_norm`` in total; return the norm measured before clipping.

    ``max_norm <= 0`` measures the norm without clipping (Megatron's ``--clip-grad 0``).
    Works for plain tensors and DTensors; see :func:`get_grad_norm` for ``reduce_group``.
    With a non-finite norm the gradients become 0 (inf) or nan (nan): callers that
    skip such steps (the fp16 loss scaler) check before or look at the returned norm.
    """
    params = [p for p in params if p.grad is not None]
    total = get_grad_norm(params, norm_type, reduce_group=reduce_group)
    if max_norm > 0.0 and params:
        clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total
