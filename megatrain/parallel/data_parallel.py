"""Data parallelism: replicated (DDP) or sharded (FSDP2, ZeRO stages 1-3) over the ``dp`` mesh axis.

=============================================  ==================================================
flags                                          implementation
=============================================  ==================================================
(default), tensor parallel off                 ``DistributedDataParallel`` (all-reduce in buckets
                                               of ``--ddp-bucket-size`` elements, overlapped with
                                               the backward pass)
--use-distributed-optimizer / --zero-stage 1|2 ``fully_shard(reshard_after_forward=False)``:
                                               optimizer state and gradients sharded, parameters
                                               gathered once per step (ZeRO-2; also used for 1)
--zero-stage 3                                 ``fully_shard(reshard_after_forward=True)``:
                                               parameters sharded too, gathered per layer
tensor parallel on, no ZeRO flag               FSDP2 as for ZeRO-2 (DDP does not take DTensor
                                               parameters); same numbers as a replicated run
--overlap-param-gather                         explicit FSDP2 prefetch of the next layer's
                                               parameters (forward) and the previous (backward)
mixture-of-experts model, more than one rank   FSDP2 as for ZeRO-2 (or as the ZeRO flag says); each
                                               MoE layer's ``mlp.experts`` is sharded on its own
                                               over the expert-data-parallel ranks first
                                               (:mod:`megatrain.parallel.expert_parallel`)
--bf16                                         FSDP2 MixedPrecisionPolicy(param_dtype=bf16,
                                               reduce_dtype=fp32, or bf16 with
                                               --grad-reduce-in-bf16; DDP: bf16_compress_hook
                                               on CUDA); master weights stay fp32
=============================================  ==================================================

Gradients are averaged over the dp ranks, so with each rank's loss the mean over its micro-batches
the result equals one process averaging all micro-batches of the global batch. During gradient
accumulation only the last micro-batch communicates (:func:`gradient_sync`).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

try:  # torch >= 2.6 exports FSDP2 publicly
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - older layouts
    from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # type: ignore
from torch.nn.parallel import DistributedDataParallel

from megatrain.models.common.layer_stacks import transformer_layers

# Megatron's default bucket: max(40M, 1M x dp) elements.
_DEFAULT_BUCKET_ELEMENTS = 40_000_000


@dataclass
class DataParallelConfig:
    zero_stage: int = 0
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: int | None = None  # --ddp-bucket-size, in elements (Megatron's unit)
    param_dtype: torch.dtype | None = None  # bf16 compute copy of parameters (FSDP2)
    grad_reduce_in_bf16: bool = False

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(f"--ddp-bucket-size must be positive, got {self.bucket_size}")


def uses_fsdp(cfg: DataParallelConfig, tensor_parallel: bool) -> bool:
    return cfg.zero_stage > 0 or tensor_parallel


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, cfg: DataParallelConfig,
               expert_mesh: DeviceMesh | None = None) -> bool:
    """``fully_shard`` every transformer layer, then the root (embeddings, final norm, head).

    ``expert_mesh`` (expert parallel runs: the ``edp`` mesh): each mixture-of-experts layer's
    ``mlp.experts`` is sharded over it first, so that its gradients are reduced over the ranks that
    hold the same experts, not over ``dp_mesh``.

    Returns whether the gathered parameters stay unsharded between the micro-batches of an
    iteration (what :func:`gradient_sync` needs to know)."""
    # The model's per-token loss is a view of the loss kernel's output; nothing modifies it in place,
    # which is what FSDP2's warning about returned views guards against.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    reshard = cfg.zero_stage == 3
    if cfg.param_dtype is not None:
        reduce_dtype = torch.bfloat16 if cfg.grad_reduce_in_bf16 else torch.float32
        mp = MixedPrecisionPolicy(param_dtype=cfg.param_dtype, reduce_dtype=reduce_dtype)
    else:
        mp = MixedPrecisionPolicy()
    layers = transformer_layers(model)  # every stack's, in forward order (encoder, then decoder)
    for layer in layers:
        if expert_mesh is not None:
            from megatrain.parallel.expert_parallel import moe_layers

            for moe in moe_layers(layer):
                fully_shard(moe.experts, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    # ZeRO-1/2 keep the gathered (compute-dtype) parameters between the micro-batches of an
    # iteration, as Megatron's distributed optimizer does; ZeRO-3 regathers them per use.
    if cfg.overlap_param_gather and len(layers) > 1:
        for i, layer in enumerate(layers):
            if i + 1 < len(layers) and hasattr(layer, "set_modules_to_forward_prefetch"):
                layer.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0 and hasattr(layer, "set_modules_to_backward_prefetch"):
                layer.set_modules_to_backward_prefetch([layers[i - 1]])
    return not reshard


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, cfg: DataParallelConfig,
              device: torch.device) -> DistributedDataParallel:
    """Replicated data parallel; the model must hold its initial weights already (rank 0's are broadcast)."""
    elements = cfg.bucket_size or max(_DEFAULT_BUCKET_ELEMENTS, 1_000_000 * dp_mesh.size())
    bytes_per_grad = 2 if cfg.grad_reduce_in_bf16 else 4
    ddp = DistributedDataParallel(
        model, process_group=dp_mesh.get_group(), device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=elements * bytes_per_grad / 2**20, gradient_as_bucket_view=True)
    if cfg.grad_reduce_in_bf16 and device.type == "cuda":  # torch's hook needs NCCL; gloo reduces in fp32
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        ddp.register_comm_hook(dp_mesh.get_group(), bf16_compress_hook)
    return ddp


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 and tensor parallelism keep the module itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool, keep_unsharded: bool = False) -> Iterator[None]:
    """Forward and backward of one micro-batch; gradients are reduced across dp only if ``enabled``.

    Use ``enabled=False`` for every micro-batch but the last of an iteration. ``keep_unsharded``
    (what :func:`apply_fsdp` returned): FSDP2 keeps the gathered parameters until the last one.
    """
    if isinstance(model, DistributedDataParallel):
        with contextlib.nullcontext() if enabled else model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        keep = keep_unsharded
        model.set_requires_gradient_sync(enabled)
        if keep:
            model.set_reshard_after_backward(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
            if keep:
                model.set_reshard_after_backward(True)
    else:
        yield
