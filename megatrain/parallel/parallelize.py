"""``parallelize_model``: turn a family's model (or pipeline stage) built on the meta device into a
sharded, initialised one, and return everything it made (:class:`Parallelized`).

The steps always run in this order:

0. with ``--fp8-format``, the transformer layers' linear layers become fp8 (:mod:`megatrain.runtime.fp8`);
1. tensor / sequence parallel plans by module path (the family's plan, applied by
   :mod:`megatrain.parallel.tensor_parallel`), then the context-parallel key/value gather (:mod:`megatrain.parallel.context_parallel`),
   then expert parallelism for mixture-of-experts layers (experts sharded over ``ep``, token dispatchers,
   router groups: :mod:`megatrain.parallel.expert_parallel`);
2. activation checkpointing (:mod:`megatrain.parallel.recompute`);
3. per-layer ``torch.compile`` (``--use-torch-compile``, or any ``compile_fn``), and the head's
   loss head: chunked float32 cross entropy (``--cross-entropy-chunk-size``) unless tensor parallel
   already made it vocab-parallel;
4. FSDP2 ``fully_shard`` per layer, then the root (ZeRO stages, or tensor parallel runs, or any
   distributed run of a mixture-of-experts model), over the data x context parallel ranks; each MoE
   layer's experts first, over the expert-data-parallel ranks;
5. materialise (``to_empty``) and fill every parameter from the family's ``initial_value`` -- each
   rank writes only its shard of the full tensor, so the weights are identical for every layout;
   then, with half-precision compute on plain weights, the layers' linear layers accumulate their
   weight gradients in float32 inside the matmuls (:mod:`megatrain.runtime.grad_accumulation_fusion`;
   ``Parallelized.grad_fusion`` is the protocol the trainer follows per micro-batch);
6. DDP wrapping (replicated data parallel), which needs materialised weights.

On CUDA, a small probe then checks that SDPA has a fused attention kernel for the model's head
dim, dtype and masks, and warns when only the slow math fallback would run.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from megatrain.host_threads import host_threads
from megatrain.models.common.init import canonical_parameter_name, drawing_on
from megatrain.models.common.layer_stacks import transformer_layers
from megatrain.models.registry import ModelFamily, family_of_config
from megatrain.runtime.attention_backends import warn_if_attention_falls_back
from megatrain.runtime.fp8 import Fp8Config, convert_to_fp8, fp8_layer_linears
from megatrain.runtime.fp8_fusion import convert_fp8_linears, fits_fp8_matmuls, grad_dtype_of
from megatrain.runtime.fp8_head import Fp8HeadWeights
from megatrain.runtime.fp8_scaling import Fp8Recipe
from megatrain.runtime.fused_loss import ChunkedCrossEntropy
from megatrain.runtime.embedding_grad_fusion import convert_tied_embeddings
from megatrain.runtime.grad_accumulation_fusion import GradAccumulationFusion, convert_linears
from megatrain.parallel.context_parallel import apply_context_parallel
from megatrain.parallel.data_parallel import DataParallelConfig, apply_ddp, apply_fsdp, uses_fsdp
from megatrain.parallel.dims import ParallelDims
from megatrain.parallel.expert_parallel import apply_expert_parallel, moe_layers
from megatrain.parallel.recompute import RecomputeConfig, apply_activation_checkpointing
from megatrain.parallel.tensor_parallel import apply_tensor_parallel, enable_async_tensor_parallel


@dataclass
class ParallelizeConfig:
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    compile_layers: bool = False
    cross_entropy_chunk_size: int = 0  # 0: logits, then the plain loss
    compute_dtype: torch.dtype = torch.float32  # for the attention-kernel probe on CUDA
    attention_mask: bool = False  # explicit masks (--reset-attention-mask), for the same probe
    compile_mode: str = "default"  # --torch-compile-mode
    compile_scope: str = "auto"  # --torch-compile-scope: "layer", "model", or "auto" (model where allowed)
    fp8_format: str | None = None  # --fp8-format: fp8 matmuls in the transformer layers
    # fp8 layers on the gradient-accumulation fusion's protocol where the fusion applies (megatrain's
    # own, weights cast once per step); False: torchao's layers everywhere (MEGATRAIN_FP8_BACKEND=torchao)
    fp8_fused: bool = True
    # --fp8-recipe and delayed scaling's settings (megatrain's fp8 layers; torchao's scale tensorwise)
    fp8_recipe: Fp8Recipe = field(default_factory=Fp8Recipe)
    # the output layer's matmuls in fp8 too (MEGATRAIN_FP8_OUTPUT_LAYER=1; megatrain's fp8 layers and the
    # chunked loss head only): an experiment, off by default
    fp8_output_layer: bool = False
    tp_comm_overlap: bool = False  # --tp-comm-overlap: async TP (CUDA, compiled, sequence parallel)
    # fp32 weight-gradient accumulation inside the half-precision layers' matmuls: None = where it
    # applies (--bf16/--fp16 without FSDP2, TP, PP, fp8 or full recompute); False: off
    # (--no-gradient-accumulation-fusion); True: also with float32 compute (tests)
    grad_accumulation_fusion: bool | None = None
    # --use-cpu-initialization: initial values drawn on the CPU (its generator's values) where the model is on a GPU
    cpu_initialization: bool = False

    def __post_init__(self) -> None:
        if self.compile_scope not in ("auto", "layer", "model"):
            raise ValueError(f"--torch-compile-scope must be auto, layer or model, got {self.compile_scope!r}")


def whole_model_compile_allowed(*, tp: int, pp: int, cp: int, sharded_data_parallel: bool) -> bool:
    """Whether one compiled region can span the whole model: no TP, PP, CP or FSDP2 hooks between
    the layers (one process, or replicated data parallel)."""
    return tp == 1 and pp == 1 and cp == 1 and not sharded_data_parallel


@dataclass
class Parallelized:
    """What :func:`parallelize_model` made: the trainer reads these, nothing is attached to the model."""

    model: nn.Module  # what forward and backward run: the module, or its DDP wrapper
    module: nn.Module  # the family's module itself (parameters, state dicts, methods)
    loss_head: Any = None  # the language-model head's loss (None for models without one)
    grad_fusion: GradAccumulationFusion | None = None  # the per-micro-batch protocol, where it applies
    fp8_report: tuple[list[str], list[str]] | None = None  # (fp8 linear layers, layer linears kept)
    keep_unsharded: bool = False  # FSDP2 keeps gathered parameters between micro-batches (ZeRO-1/2)


def parallelize_model(model: nn.Module, dims: ParallelDims, cfg: ParallelizeConfig, *, device: torch.device,
                      seed: int, family: ModelFamily | None = None, config: Any = None,
                      compile_fn: Callable[[nn.Module], None] | None = None,
                      pipeline_stage: bool = False) -> Parallelized:
    """Apply parallelism to ``model`` (ideally on the meta device), initialise it and return what was made.

    ``family`` defaults to the family of ``config`` (default ``model.config``). ``pipeline_stage``:
    ``model`` is one pipeline stage (``megatrain.parallel.pipeline.PipelineParallel.build`` passes it).
    """
    config = config or model.config
    family = family or family_of_config(config)
    if dims.pp > 1 and not pipeline_stage:
        raise ValueError("parallelize_model applies tensor, sequence, context and data parallelism to one model or "
                         f"one pipeline stage; with --pipeline-model-parallel-size {dims.pp} build the stages "
                         "with megatrain.parallel.pipeline.PipelineParallel.build")
    distributed = dims.world_size > 1
    # Pipeline stages use FSDP2 for data parallel too: the schedules' split backward passes do not
    # fit DDP's reducer with several stages per rank. One process with --use-distributed-optimizer /
    # --zero-stage: FSDP2 over a mesh of one rank, for its mixed precision (bf16 compute weights
    # cast once per iteration, fp32 gradient accumulation).
    single = dims.world_size == 1 and cfg.data_parallel.zero_stage > 0
    fsdp = (single or (distributed and dims.replicas > 1)) and uses_fsdp(cfg.data_parallel,
                                                                        dims.tp_enabled or dims.pp > 1)
    # Mixture-of-experts: FSDP2 whenever there are several ranks (also a mesh of one data-parallel
    # rank), so that the experts' gradients are reduced over the ranks holding the same experts.
    expert_fsdp = distributed and any(True for _ in moe_layers(model))
    fsdp = fsdp or expert_fsdp
    # --mtp-use-repeated-layer runs one depth's linears several times in a forward: each run would save the
    # staged buffer the first run's backward adds into, so the fusion is off then (as for a reused head below).
    repeated_depth = getattr(config, "mtp_use_repeated_layer", False) and getattr(config, "mtp_num_layers", 0) > 1
    fusion_applies = grad_accumulation_fusion_applies(cfg, dims, fsdp) and not repeated_depth
    fp8_fused = cfg.fp8_format is not None and fusion_applies  # fp8 on the fusion's protocol
    fp8_report = None
    if fp8_fused:
        fp8_report = fp8_layer_linears(model, tp=dims.tp)
    elif cfg.fp8_format is not None:
        fp8_report = convert_to_fp8(model, Fp8Config(cfg.fp8_format), tp=dims.tp)
    if dims.tp_enabled:
        dims.validate_model(config)
        apply_tensor_parallel(model, dims.submesh("tp"), sequence_parallel=dims.sequence_parallel,
                              loss_chunk_size=cfg.cross_entropy_chunk_size,
                              compile_loss=cfg.compile_layers and device.type == "cuda",
                              plan=family.tensor_parallel_plan(model, sequence_parallel=dims.sequence_parallel))
        if cfg.tp_comm_overlap:
            assert dims.sequence_parallel and cfg.compile_layers and device.type == "cuda", \
                "--tp-comm-overlap needs sequence parallelism and compiled layers on CUDA (checked with the flags)"
            enable_async_tensor_parallel(dims.submesh("tp"))
    if dims.cp > 1:
        apply_context_parallel(model, dims.submesh("cp"))
    apply_expert_parallel(model, dims)
    apply_activation_checkpointing(model, cfg.recompute)
    whole_model_ok = whole_model_compile_allowed(tp=dims.tp, pp=dims.pp, cp=dims.cp, sharded_data_parallel=fsdp)
    compile_model = (cfg.compile_layers and compile_fn is None
                     and (cfg.compile_scope == "model"
                          or cfg.compile_scope == "auto" and whole_model_ok
                          and (cfg.fp8_format is None or fp8_fused)))
    if compile_model and not whole_model_ok:
        raise ValueError("--torch-compile-scope model compiles the whole model of one process or of a "
                         "replicated (DDP) data-parallel run; with --tensor-model-parallel-size, "
                         "--pipeline-model-parallel-size, --context-parallel-size, --use-distributed-optimizer or "
                         "--zero-stage use "
                         "--torch-compile-scope layer")
    mode = None if cfg.compile_mode == "default" else cfg.compile_mode
    if compile_fn is None and cfg.compile_layers and not compile_model:
        compile_fn = lambda module: module.compile(mode=mode)  # noqa: E731
    if compile_fn is not None:
        for layer in transformer_layers(model):
            compile_fn(layer)
    if compile_model:  # one region from the embedding to the final norm; the chunked loss stays outside
        model.compile(mode=mode)
    has_lm_head = hasattr(model, "loss_head")  # models with a language-model head declare the slot
    if cfg.cross_entropy_chunk_size > 0 and not dims.tp_enabled and has_lm_head:
        model.loss_head = ChunkedCrossEntropy(cfg.cross_entropy_chunk_size,
                                              compile=cfg.compile_layers and device.type == "cuda")
    expert_mesh = dims.expert_mesh()["edp"] if expert_fsdp else None
    keep_unsharded = apply_fsdp(model, dims.replica_mesh(), cfg.data_parallel, expert_mesh) if fsdp else False
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
    init_parameters(model, config, seed, family.initial_value, on_cpu=cfg.cpu_initialization)
    fusion = None
    if fusion_applies:
        fp8_linears = []
        if fp8_fused:
            assert fp8_report is not None
            modules = dict(model.named_modules())
            fp8_linears = convert_fp8_linears([modules[name] for name in fp8_report[0]], cfg.fp8_format,
                                              cfg.compute_dtype, compile_cast=cfg.compile_layers,
                                              recipe=cfg.fp8_recipe)
        linears = convert_linears(m for layer in transformer_layers(model) for m in layer.modules())
        head = model.loss_head if has_lm_head else None  # the output weight's matmuls, in the chunked loss
        # (the fusion applies without pipeline stages only, so the model is whole and holds its head).
        # Multi-token prediction runs the head (and the word embeddings) once per depth more in a forward:
        # each use would save the one staged buffer the first use's backward adds into, so there the output
        # weight and the embeddings keep autograd's accumulation (the layers' linears, each used once, fuse).
        reused_head = bool(getattr(config, "mtp_num_layers", 0))
        extra = [(head, model.output_weight())] if isinstance(head, ChunkedCrossEntropy) and not reused_head else []
        if fp8_fused and cfg.fp8_output_layer and extra and model.output_bias() is None \
                and fits_fp8_matmuls(*extra[0][1].shape):
            head.fp8_weights = Fp8HeadWeights(grad_dtype_of(cfg.fp8_format), compile_cast=cfg.compile_layers)
        if linears or extra or fp8_linears:
            # a word embedding tied to the output layer adds its rows into the output weight's staged gradient
            embeddings = convert_tied_embeddings(model, extra[0][1]) if extra else []
            fusion = GradAccumulationFusion(linears, cfg.compute_dtype, extra, others=model.parameters(),
                                            fp8_linears=fp8_linears, embeddings=embeddings)
    if device.type == "cuda":
        # An encoder's padding mask is an explicit mask too (flash attention takes only causal ones).
        warn_if_attention_falls_back(config, cfg.compute_dtype, device,
                                     explicit_mask=cfg.attention_mask or not config.causal_attention
                                     or getattr(config, "window_size", None) is not None)
    wrapped = model
    if distributed and dims.replicas > 1 and not fsdp:
        wrapped = apply_ddp(model, dims.replica_mesh(), cfg.data_parallel, device)
    return Parallelized(wrapped, model, model.loss_head if has_lm_head else None, fusion, fp8_report,
                        keep_unsharded)


def grad_accumulation_fusion_applies(cfg: ParallelizeConfig, dims: ParallelDims, fsdp: bool) -> bool:
    """Whether the layers' linear layers accumulate weight gradients in their matmuls
    (:mod:`megatrain.runtime.grad_accumulation_fusion`): half-precision compute on plain (not
    FSDP2-sharded, not tensor-parallel) float32 weights, one pipeline stage, and no recomputation of
    linear layers (:func:`recomputes_linears`). With ``--fp8-format``
    the fp8 layers follow the same protocol (:mod:`megatrain.runtime.fp8_fusion`) unless
    ``MEGATRAIN_FP8_BACKEND=torchao`` (``cfg.fp8_fused`` False) asks for torchao's layers everywhere."""
    if cfg.grad_accumulation_fusion is False:
        return False
    if cfg.grad_accumulation_fusion is None and cfg.compute_dtype == torch.float32:
        return False
    return (not fsdp and not dims.tp_enabled and dims.pp == 1 and (cfg.fp8_format is None or cfg.fp8_fused)
            and not recomputes_linears(cfg.recompute))


def recomputes_linears(recompute: RecomputeConfig) -> bool:
    """Whether recomputation runs linear layers' forward again in the backward pass (whole layers, MLPs, MoE
    layers or shared experts): that second forward would not see the fusion's staged gradients, which are
    released after the first, so the fusion is off then."""
    return (recompute.granularity == "full" or recompute.moe_layer
            or any(m in (recompute.modules or ()) for m in ("mlp", "shared_experts")))


# Bytes of drawn values that may wait for their copy at once (one larger tensor still goes alone).
_INIT_BYTES_IN_FLIGHT = 2 << 30


def _in_order(fn: Callable[[Any], torch.Tensor], items: list, workers: int, nbytes: Callable[[Any], int],
              budget: int = _INIT_BYTES_IN_FLIGHT) -> Iterator[torch.Tensor]:
    """``fn(item)`` for each item, in order, computed by ``workers`` threads ahead of the consumer while
    the results not yet consumed hold at most ``budget`` bytes (``nbytes(item)`` each)."""
    if workers <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="init") as pool:
        pending: deque = deque()
        held = 0
        for item in items:
            size = nbytes(item)
            while pending and (held + size > budget or len(pending) >= 2 * workers):
                future, done_size = pending.popleft()
                held -= done_size
                yield future.result()
            pending.append((pool.submit(fn, item), size))
            held += size
        while pending:
            yield pending.popleft()[0].result()


@torch.no_grad()
def init_parameters(model: nn.Module, config: Any, seed: int,
                    initial_value: Callable[..., torch.Tensor] | None = None, workers: int | None = None,
                    on_cpu: bool = False) -> None:
    """Fill every parameter (plain or DTensor) with its shard of ``initial_value(name, full shape)``
    (default: the family of ``config``'s rules). Each value comes from its own seeded generator.

    Parameters on a CUDA device get values drawn there (:func:`~megatrain.models.common.init.drawing_on`:
    no host drawing, no host-to-device copy of the model), one after another; ``on_cpu``
    (``--use-cpu-initialization``) draws them on the CPU instead. On the CPU ``workers`` threads (default:
    this process's share of the usable cores, at most 16) draw them at once with the same result (at most
    2 GiB of drawn values waiting for their copy), the largest first (one tensor is one generator's stream:
    the embedding and output layer bound the time). Each thread fills the plain parameters it drew; DTensor
    shards are cut and filled on this thread (the same order on every rank)."""
    initial_value = initial_value or family_of_config(config).initial_value
    named = sorted(model.named_parameters(), key=lambda item: -item[1].numel())  # stable: ties in model order
    device = _local(named[0][1]).device if named else torch.device("cpu")
    if device.type == "cuda" and not on_cpu:
        with drawing_on(device):
            for name, param in named:
                full = initial_value(canonical_parameter_name(name), param.shape, config, seed)
                if isinstance(param, DTensor):
                    _local(param).copy_(_local_shard(full.to(dtype=param.dtype), param))
                else:
                    param.copy_(full)
        return

    def draw(item: tuple[str, torch.Tensor]) -> torch.Tensor | None:
        name, param = item
        full = initial_value(canonical_parameter_name(name), param.shape, config, seed)
        if isinstance(param, DTensor):
            return full  # sharded on this thread, in the same order on every rank
        # A plain parameter is filled here, in the drawing thread: on a CPU the first writes to its fresh
        # memory (page faults) and on a GPU the staging of the pageable host-to-device copy run in parallel.
        with torch.no_grad():  # grad mode is per thread
            param.copy_(full.to(dtype=param.dtype))
        return None

    values = _in_order(draw, named, workers or host_threads(), nbytes=lambda item: 4 * item[1].numel())
    for (name, param), full in zip(named, values):
        if isinstance(param, DTensor):
            assert full is not None
            local = param.to_local()
            shard = _local_shard(full.to(device=local.device, dtype=local.dtype), param)
            local.copy_(shard)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _local_shard(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's part of ``full`` for the placements of ``like``, without communication."""
    try:
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
    except TypeError:  # torch without src_data_rank
        replicated = DTensor.from_local(full, like.device_mesh, [Replicate()] * like.device_mesh.ndim,
                                        run_check=False)
        return replicated.redistribute(like.device_mesh, like.placements).to_local()
