"""RunConfig: the typed configuration of one run, made from the parsed flags in this one place.

The Megatron-style namespace (`megatrain.training.arguments.parse_args`) becomes the typed configs
each component takes: the parallel layout (:class:`ParallelDims`), the pipeline
(:class:`PipelineConfig`), what ``parallelize_model`` applies (:class:`ParallelizeConfig`: data
parallelism, recomputation, compilation, fp8, ...), the data (:class:`DataConfig`), the optimizer,
the learning-rate schedule and the compute precision. `megatrain.parallel` never sees the namespace.

Each config checks its own fields and raises ValueError naming the flag. `validate_args` builds a
RunConfig so that those checks stop a bad command line at parse time (as one ``error:`` line), and
the trainer builds the one it runs with. The namespace must be one `validate_args` has completed
(the world size, the ZeRO stage, the device-dependent defaults are filled in there).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

from megatrain.data.config import DataConfig
from megatrain.parallel.data_parallel import DataParallelConfig
from megatrain.parallel.dims import ParallelDims
from megatrain.parallel.parallelize import ParallelizeConfig
from megatrain.parallel.pipeline import PipelineConfig
from megatrain.parallel.recompute import RecomputeConfig
from megatrain.runtime.fp8_scaling import Fp8Recipe
from megatrain.training.builders import Precision
from megatrain.training.lr_schedule import LRScheduleConfig, lr_schedule_config_from_args
from megatrain.optimizer import OptimizerConfig

__all__ = ["RunConfig", "parallel_dims_from_args", "pipeline_config_from_args"]


@dataclass
class RunConfig:
    """Every typed config of a run (the model's shape comes later, with the tokenizer's vocabulary)."""

    dims: ParallelDims
    pipeline: PipelineConfig
    parallelize: ParallelizeConfig
    data: DataConfig
    optimizer: OptimizerConfig
    lr_schedule: LRScheduleConfig
    precision: Precision

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RunConfig":
        """From a namespace `validate_args` has checked and completed; ValueError names the flag."""
        precision = Precision.from_args(args)
        return cls(dims=parallel_dims_from_args(args), pipeline=pipeline_config_from_args(args),
                   parallelize=_parallelize_config(args, precision), data=DataConfig.from_args(args),
                   lr_schedule=lr_schedule_config_from_args(args),  # before the optimizer: "--lr is required"
                   optimizer=_optimizer_config(args), precision=precision)


def parallel_dims_from_args(args: argparse.Namespace) -> ParallelDims:
    """``--tensor/pipeline-model-parallel-size``, ``--context-parallel-size`` over the launcher's world."""
    return ParallelDims(world_size=args.world_size_actual, tp=args.tensor_model_parallel_size,
                        pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size,
                        sequence_parallel=args.sequence_parallel, ep=args.expert_model_parallel_size,
                        etp=args.expert_tensor_parallel_size, moe_dispatcher=moe_dispatcher(args))


def moe_dispatcher(args: argparse.Namespace) -> str:
    """``--moe-token-dispatcher-type``'s dispatcher: Megatron's flex (DeepEP / HybridEP kernels moving the same
    tokens as its all-to-all) runs as alltoall."""
    kind = args.moe_token_dispatcher_type
    return "alltoall" if kind == "flex" else kind


def pipeline_config_from_args(args: argparse.Namespace) -> PipelineConfig:
    """The pipeline flags; ``--num-layers-per-virtual-pipeline-stage N`` gives v = layers per rank / N."""
    pp = args.pipeline_model_parallel_size
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    v = args.num_virtual_stages_per_pipeline_rank
    per_virtual = args.num_layers_per_virtual_pipeline_stage
    if per_virtual is not None:
        if v is not None:
            raise ValueError("give only one of --num-layers-per-virtual-pipeline-stage and "
                             "--num-virtual-stages-per-pipeline-rank")
        if first is not None or last is not None:
            raise ValueError("--num-layers-per-virtual-pipeline-stage assumes equal stages; with "
                             "--decoder-first/last-pipeline-num-layers use --num-virtual-stages-per-pipeline-rank")
        if per_virtual < 1:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage must be at least 1, got {per_virtual}")
        layers = args.num_layers
        if layers % pp or (layers // pp) % per_virtual:
            raise ValueError(f"--num-layers ({layers}) must be divisible by --pipeline-model-parallel-size ({pp}) "
                             f"x --num-layers-per-virtual-pipeline-stage ({per_virtual})")
        v = layers // pp // per_virtual
    return PipelineConfig(size=pp, virtual_stages=v or 1, first_stage_layers=first, last_stage_layers=last,
                          schedule=args.pipeline_schedule)


def _parallelize_config(args: argparse.Namespace, precision: Precision) -> ParallelizeConfig:
    data_parallel = DataParallelConfig(
        zero_stage=args.zero_stage, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, bucket_size=args.ddp_bucket_size,
        param_dtype=torch.bfloat16 if args.bf16 else None, grad_reduce_in_bf16=args.grad_reduce_in_bf16)
    recompute = RecomputeConfig(args.recompute_granularity, args.recompute_method, args.recompute_num_layers,
                                moe_layer=args.moe_layer_recompute,
                                modules=None if args.recompute_modules is None else tuple(args.recompute_modules))
    return ParallelizeConfig(
        data_parallel=data_parallel, recompute=recompute, compile_layers=args.use_torch_compile,
        cross_entropy_chunk_size=args.cross_entropy_chunk_size, compute_dtype=precision.dtype,
        attention_mask=args.reset_attention_mask, compile_mode=args.torch_compile_mode,
        compile_scope=args.torch_compile_scope, fp8_format=args.fp8_format, tp_comm_overlap=args.tp_comm_overlap,
        grad_accumulation_fusion=False if args.no_gradient_accumulation_fusion else None,
        fp8_fused=fp8_backend_from_env() == "fused", fp8_output_layer=fp8_output_layer_from_env(),
        fp8_recipe=Fp8Recipe(args.fp8_recipe == "delayed", args.fp8_margin, args.fp8_amax_history_len,
                             args.fp8_amax_compute_algo),
        cpu_initialization=args.use_cpu_initialization)


def _optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                           adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                           sgd_momentum=args.sgd_momentum, decoupled_lr=args.decoupled_lr,
                           decoupled_min_lr=args.decoupled_min_lr, adamw_kernel=adamw_kernel_from_env())


ADAMW_KERNEL_ENV = "MEGATRAIN_ADAMW_KERNEL"
FP8_BACKEND_ENV = "MEGATRAIN_FP8_BACKEND"
FP8_OUTPUT_LAYER_ENV = "MEGATRAIN_FP8_OUTPUT_LAYER"


def fp8_backend_from_env() -> str:
    """``MEGATRAIN_FP8_BACKEND``: ``fused`` (the default: megatrain's fp8 layers on the gradient-accumulation
    fusion's protocol where that applies, torchao's elsewhere) or ``torchao`` (torchao's float8 layers
    everywhere); another value is an error at start-up."""
    value = os.environ.get(FP8_BACKEND_ENV, "").strip() or "fused"
    if value not in ("torchao", "fused"):
        raise ValueError(f"{FP8_BACKEND_ENV} must be torchao or fused, got {value!r}")
    return value


def _switch_from_env(name: str) -> bool | None:
    """An environment switch: 1 (True), 0 (False) or unset (None); another value is an error at start-up."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return None if value == "" else value == "1"


def adamw_kernel_from_env() -> bool | None:
    """``MEGATRAIN_ADAMW_KERNEL``: 1 (AdamW through megatrain's Triton kernel wherever it applies), 0
    (torch's fused AdamW) or unset (None: the kernel on CUDA for large models, see
    ``megatrain.optimizer.KERNEL_ADAMW_MIN_PARAMETERS``)."""
    return _switch_from_env(ADAMW_KERNEL_ENV)


def fp8_output_layer_from_env() -> bool:
    """``MEGATRAIN_FP8_OUTPUT_LAYER``: 1 (the output layer in fp8 where ``--fp8-format`` runs megatrain's
    fp8 layers and the chunked loss head, :mod:`megatrain.runtime.fp8_head`) or 0 / unset."""
    return bool(_switch_from_env(FP8_OUTPUT_LAYER_ENV))
