"""The optimizer with Megatron-LM's parameter groups, and gradient-norm clipping.

Parameter groups follow Megatron: every trainable parameter that is 1-D (norm
weights, biases) or whose name ends in ``.bias`` gets ``wd_mult = 0`` (no weight
decay); all others decay. The groups are always created in the same order
(decay, then no decay), also when one is empty, so optimizer state dicts line up
across ranks and pipeline stages. Each group carries Megatron's schedule keys
(``wd_mult``, ``lr_mult``, ``max_lr``, ``min_lr``, ``default_config``) that
:class:`megatrain.training.lr_schedule.LRScheduler` reads.

``adam`` is AdamW (decoupled weight decay, bias correction), what Megatron's
fused Adam does by default; ``decoupled_weight_decay=False`` gives Adam with L2
regularisation. ``sgd`` is SGD with momentum and L2 weight decay.

Parameters may be DTensors (tensor parallel, FSDP2): only ``ndim``, names and
devices are looked at, and the norm is computed through DTensor so sharded and
replicated parameters count once.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch import nn

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class OptimizerConfig:
    """Optimizer hyper-parameters (Megatron's flags and defaults).

    ``fused`` / ``foreach``: ``None`` picks fused kernels when every parameter is a
    floating-point CUDA tensor and the multi-tensor (foreach) path otherwise.
    """

    optimizer: str = "adam"
    lr: float = 1.0e-3
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    sgd_momentum: float = 0.9
    decoupled_weight_decay: bool = True
    fused: bool | None = None
    foreach: bool | None = None
    decoupled_lr: float | None = None  # --decoupled-lr: the input embedding and output layer
    decoupled_min_lr: float | None = None  # --decoupled-min-lr (default min_lr)

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"--optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.lr < 0.0:
            raise ValueError(f"--lr must be >= 0, got {self.lr}")
        if self.weight_decay < 0.0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        for flag, beta in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"{flag} must be in [0, 1), got {beta}")
        if self.adam_eps <= 0.0:
            raise ValueError(f"--adam-eps must be positive, got {self.adam_eps}")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ValueError("--decoupled-min-lr needs --decoupled-lr")
        if self.decoupled_lr is not None:
            low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
            if not 0.0 <= low <= self.decoupled_lr:
                raise ValueError(f"--decoupled-lr ({self.decoupled_lr}) must be >= --decoupled-min-lr ({low}) >= 0")


def is_no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: 1-D parameters and biases are not decayed."""
    return param.ndim == 1 or name == "bias" or name.endswith(".bias")


def _model_chunks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


# Parameters that --decoupled-lr schedules on their own (Megatron: the input embedding and output layer;
# with tied embeddings they are one tensor).
_DECOUPLED_LR_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _kernel_key(p: torch.Tensor) -> int | None:
    """Which multi-tensor kernel call a parameter can share: plain tensors, or DTensors of one mesh."""
    mesh = getattr(p, "device_mesh", None)
    return None if mesh is None else id(mesh)


def build_param_groups(model: nn.Module | Sequence[nn.Module], cfg: OptimizerConfig) -> list[dict[str, Any]]:
    """The parameter groups (decay, no decay) over all trainable parameters.

    ``model`` may be a list of model chunks (virtual pipeline stages); a parameter
    shared between chunks is listed once. When a model mixes plain tensors and
    DTensors (tensor parallel without FSDP: norms stay plain) or DTensors of
    several meshes, each of the two groups is split by kind, in order of first
    appearance, so that every group can run as one fused (or foreach) kernel call;
    the split groups carry the same hyper-parameters.
    """
    from megatrain.models.gpt import canonical_parameter_name

    # (decoupled, no weight decay) -> parameters; decoupled: --decoupled-lr's embedding and output layer
    lists: dict[tuple[bool, bool], list[torch.Tensor]] = {(d, n): [] for d in (False, True) for n in (False, True)}
    seen: set[int] = set()
    for chunk in _model_chunks(model):
        for name, p in chunk.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            decoupled = cfg.decoupled_lr is not None and canonical_parameter_name(name) in _DECOUPLED_LR_PARAMS
            lists[(decoupled, is_no_weight_decay(name, p))].append(p)

    def group(params: list[torch.Tensor], wd_mult: float, decoupled: bool = False) -> dict[str, Any]:
        max_lr = cfg.decoupled_lr if decoupled else cfg.lr
        min_lr = cfg.decoupled_min_lr if decoupled and cfg.decoupled_min_lr is not None else cfg.min_lr
        return {
            "params": params,
            "wd_mult": wd_mult,
            "lr_mult": 1.0,
            "max_lr": max_lr,
            "min_lr": min_lr,
            "default_config": not decoupled,
            "is_expert_parallel": False,
            "is_decoupled_lr": decoupled,
            "lr": max_lr,
            "weight_decay": cfg.weight_decay * wd_mult,
        }

    def split(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        parts: dict[int | None, list[torch.Tensor]] = {}
        for p in params:
            parts.setdefault(_kernel_key(p), []).append(p)
        return list(parts.values()) or [[]]

    groups = [group(part, 1.0) for part in split(lists[(False, False)])]
    groups += [group(part, 0.0) for part in split(lists[(False, True)])]
    for no_wd in (False, True):  # only with --decoupled-lr, and only groups that hold parameters
        groups += [group(part, 0.0 if no_wd else 1.0, True) for part in split(lists[(True, no_wd)]) if part]
    return groups


def _kernel_choice(params: list[torch.Tensor], cfg: OptimizerConfig) -> dict[str, bool]:
    if cfg.fused is not None or cfg.foreach is not None:
        out: dict[str, bool] = {}
        if cfg.fused is not None:
            out["fused"] = cfg.fused
        if cfg.foreach is not None:
            out["foreach"] = cfg.foreach
        return out
    all_cuda = bool(params) and all(p.is_cuda and p.dtype in _FUSED_DTYPES for p in params)
    return {"fused": True} if all_cuda else {"foreach": True}


def build_optimizer(model: nn.Module | Sequence[nn.Module], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW (or Adam / SGD) over Megatron's parameter groups."""
    groups = build_param_groups(model, cfg)
    params = [p for g in groups for p in g["params"]]
    if not params:
        raise ValueError("the model has no trainable parameters")
    kernels = _kernel_choice(params, cfg)
    if cfg.optimizer == "adam":
        cls = torch.optim.AdamW if cfg.decoupled_weight_decay else torch.optim.Adam
        return cls(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                   weight_decay=cfg.weight_decay, **kernels)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay,
                           **kernels)


# -- gradient norm and clipping -----------------------------------------------------------------

def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


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
    norm_type = float(norm_type)
    plain: list[torch.Tensor] = []
    by_mesh: dict[int, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        if g is None:
            continue
        (by_mesh[id(g.device_mesh)] if _is_dtensor(g) else plain).append(g)
    parts = [_dtensor_norm(gs, norm_type) for gs in by_mesh.values()]
    if plain:
        parts.append(_plain_norm(plain, norm_type))
    if parts:
        total = _combine(parts, norm_type).float()
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        total = torch.zeros((), dtype=torch.float32, device=device)
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
    coef = torch.clamp(max_norm / (total_norm.float() + 1.0e-6), max=1.0)
    scale_grads_(params, coef, foreach=foreach)


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
