"""The optimizer with Megatron-LM's parameter groups.

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
devices are looked at. Global-norm clipping (:func:`clip_grad_norm_` and its parts)
is :mod:`megatrain.parallel.grad_norm`'s, re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

# The gradient norm and clipping live in parallel/ (the pipeline's norm over stages needs them);
# importable from here as before.
from megatrain.parallel.grad_norm import (clip_divisor, clip_grad_norm_, clip_grads_with_norm_, count_zeros,
                                          get_grad_norm, get_total_norm, scale_grads_)

__all__ = ["OptimizerConfig", "build_param_groups", "build_optimizer", "is_no_weight_decay", "folds_grad_divisor",
           "get_grad_norm", "get_total_norm", "count_zeros", "scale_grads_", "clip_divisor", "clip_grads_with_norm_",
           "clip_grad_norm_"]

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
    # AdamW through megatrain's Triton kernel (runtime/adamw_kernel.py: no gradient write-back under
    # clipping, the bf16 weight copies written in the same pass) where it applies: float32 parameters,
    # not DTensors, a device the kernel runs on. None (the default): on CUDA for models of at least
    # KERNEL_ADAMW_MIN_PARAMETERS parameters; True: wherever it applies (MEGATRAIN_ADAMW_KERNEL=1);
    # False: never (MEGATRAIN_ADAMW_KERNEL=0).
    adamw_kernel: bool | None = None

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
    from megatrain.models.common.init import canonical_parameter_name

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


def _kernel_choice(params: list[torch.Tensor], cfg: OptimizerConfig,
                   device: torch.device | None = None) -> dict[str, bool]:
    if cfg.fused is not None or cfg.foreach is not None:
        out: dict[str, bool] = {}
        if cfg.fused is not None:
            out["fused"] = cfg.fused
        if cfg.foreach is not None:
            out["foreach"] = cfg.foreach
        return out
    if not params:  # nothing to update: the kernels the parameters of ``device`` would get
        return {"fused": True} if device is not None and torch.device(device).type == "cuda" else {"foreach": True}
    all_cuda = all(p.is_cuda and p.dtype in _FUSED_DTYPES for p in params)
    return {"fused": True} if all_cuda else {"foreach": True}


# The kernel's step launches one program grid per parameter (~100-300 a model) where torch's fused AdamW
# launches a few multi-tensor kernels: a win where the step is bound by memory traffic (1.5e9 parameters:
# 15.8 against 21.6 ms on an H100, the bf16 copies included; T5-base's 2.2e8: its step 1.52x transformers'
# with it, 1.48x without, each beside transformers on an H100), a risk where the host sets the pace (GPT-2
# 124M's step waits on the host). By default it applies from this many parameters on (2^27: T5-base and
# larger, not GPT-2 124M).
KERNEL_ADAMW_MIN_PARAMETERS = 1 << 27


def _kernel_adamw_applies(params: list[torch.Tensor], cfg: OptimizerConfig) -> bool:
    if not (cfg.adamw_kernel is not False and cfg.optimizer == "adam" and cfg.decoupled_weight_decay and params):
        return False
    if cfg.adamw_kernel is None and not (all(p.is_cuda for p in params)
                                         and sum(p.numel() for p in params) >= KERNEL_ADAMW_MIN_PARAMETERS):
        return False
    from megatrain.runtime.adamw_kernel import KernelAdamW

    return KernelAdamW.applies_to(params)


def build_optimizer(model: nn.Module | Sequence[nn.Module], cfg: OptimizerConfig, *, allow_empty: bool = False,
                    device: torch.device | None = None) -> torch.optim.Optimizer:
    """AdamW (or Adam / SGD) over Megatron's parameter groups.

    A model without trainable parameters is refused unless ``allow_empty``: then the optimizer holds
    the (empty) groups and its step does nothing, for a pipeline rank whose stages are frozen while
    other stages train (``device``: where the run's parameters live, so that the empty optimizer
    picks the kernels, and with them the step's path, the other ranks' optimizers pick).
    """
    groups = build_param_groups(model, cfg)
    params = [p for g in groups for p in g["params"]]
    if not params and not allow_empty:
        raise ValueError("the model has no trainable parameters")
    if _kernel_adamw_applies(params, cfg):
        from megatrain.runtime.adamw_kernel import KernelAdamW

        return KernelAdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                           weight_decay=cfg.weight_decay)
    kernels = _kernel_choice(params, cfg, device)
    if cfg.optimizer == "adam":
        cls = torch.optim.AdamW if cfg.decoupled_weight_decay else torch.optim.Adam
        return cls(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                   weight_decay=cfg.weight_decay, **kernels)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay,
                           **kernels)


def folds_grad_divisor(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> bool:
    """Whether ``optimizer.step()`` divides the gradients by ``optimizer.grad_scale`` (a device scalar)
    as it reads them: torch's fused Adam, AdamW and SGD kernels over plain tensors (the protocol
    GradScaler uses), so gradient clipping needs no pass of its own over the gradients."""
    from megatrain.runtime.adamw_kernel import KernelAdamW

    if isinstance(optimizer, KernelAdamW):  # the divisor applied as it reads them, nothing written back
        return True
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        return False
    if not optimizer.param_groups or not all(g.get("fused") for g in optimizer.param_groups):
        return False
    return not any(hasattr(p, "device_mesh") for p in params)  # DTensors: their kernels take no plain scalar
