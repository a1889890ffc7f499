"""The pre-training loop: micro-batches, optimizer steps, evaluation, logging, exits and checkpoints.

`pretrain(args)` is what ``pretrain_gpt.py`` calls. The loop follows Megatron-LM: each
iteration consumes one global batch split into micro-batches (gradient accumulation), the
loss of a micro-batch is the mean over its unmasked tokens and the iteration's loss the mean
over micro-batches; the learning-rate schedule advances by the global batch size in samples.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatrain.checkpoint.save_lock import take_save_lock
from megatrain.training.start_parts import start_parts
from megatrain.convert import hf_start
from megatrain.convert.megatron.start import prepare_megatron_start
from megatrain.data.gpt_dataset import build_train_valid_test_datasets, num_samples_for_splits
from megatrain.data.loader import build_pretraining_data_loader
from megatrain.data.tokenizers import build_tokenizer
from megatrain.models.common.moe.metrics import MoEMetrics, MoEReport
from megatrain.models.gpt.mtp import MtpMetrics
from megatrain.models.common.objective import Objective
from megatrain.models.registry import DEFAULT_FAMILY, ModelFamily, get_family
from megatrain.parallel.distributed import (destroy_distributed, get_rank, init_distributed,
                                            init_single_process_group)
from megatrain.parallel.parallelize import Parallelized, parallelize_model
from megatrain.parallel.random import seed_everything
from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import TrainState
from megatrain.runtime.cuda_graph import MicroBatchGraphs
from megatrain.runtime.fused_loss import ChunkedCrossEntropy
from megatrain.training.batch_rampup import BatchRampup, StepBatchSchedule, batch_schedule_from_args
from megatrain.training.builders import choose_device, padded_vocab_size
from megatrain.training.console import print_rank0, print_rank_last, setup_logging
from megatrain.training.evaluation import EvaluationMixin
from megatrain.training.exits import ExitRequest
from megatrain.training.flops import CountedFlops, device_peak_tflops
from megatrain.training.fp8_scaling_state import Fp8ScalingState
from megatrain.training.housekeeping import Housekeeping
from megatrain.training.logging import MetricsWriter, format_train_log_line
from megatrain.training.loss_scaler import ConstantLossScaler, DynamicLossScaler
from megatrain.training.lr_schedule import LRScheduler
from megatrain.runtime.adamw_kernel import KernelAdamW
from megatrain.optimizer import KERNEL_ADAMW_MIN_PARAMETERS, build_optimizer
from megatrain.training.run_config import RunConfig
from megatrain.training.setup_log import SetupTimers, print_datetime, print_time_to_initialize
from megatrain.training.step import IntervalStats, StepMixin, StepResult, _PendingStep, summed

__all__ = ["Trainer", "pretrain", "print_rank0", "print_rank_last", "StepResult", "ExitRequest"]


# Arguments an HF import writes into a checkpoint's meta.json that later checkpoints of the same
# weights keep (read by the export).
PROVENANCE_ARGS = ("hf_vocab_size", "hf_architecture", "converted_from")


class Trainer(StepMixin, EvaluationMixin):
    """Owns the model, optimizer, schedule, scaler, data iterators and counters of one run of one
    model family (``family``: a registered name; the family gives the config, model, parallel plan,
    objective and formulas)."""

    def __init__(self, args: argparse.Namespace, family: str | ModelFamily = DEFAULT_FAMILY):
        self.args = args
        self.family = get_family(family) if isinstance(family, str) else family
        self.start_time = time.time()
        self.device = choose_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.run = RunConfig.from_args(args)  # every typed config of the run, made once from the flags
        self.precision = self.run.precision
        self.housekeeping = Housekeeping(args, self.device, int(os.environ.get("RANK", "0")))
        self.per_token_loss = args.calculate_per_token_loss
        self.batch_schedule: BatchRampup | StepBatchSchedule | None = None  # a changing global batch, or None
        # of the current iteration (a changing global batch: --rampup-batch-size, --step-batch-size-schedule)
        self.num_micro_batches = args.num_micro_batches
        hf_start.prepare_start(args)  # a Hugging Face folder to start from: rank 0 converts it, the others wait
        prepare_megatron_start(args)  # a Megatron-LM checkpoint in --load: rank 0 converts it, the others wait
        self.world_size = init_distributed(self.device, args.distributed_timeout_minutes).world_size
        if self.world_size != args.world_size_actual:
            raise SystemExit(f"error: the arguments were checked for a world size of {args.world_size_actual} but the "
                             f"launcher started {self.world_size} processes; set WORLD_SIZE before parsing (torchrun "
                             f"does; under srun call megatrain.parallel.distributed.setup_env_from_slurm first)")
        # Before anything is written to --save: one run at a time writes there (held until close()).
        self._save_lock = take_save_lock(args.save) if args.save else None
        self.dims = self.run.dims
        if self.world_size == 1 and args.zero_stage > 0:  # FSDP2 over one rank needs a mesh
            init_single_process_group(self.device)
        if dist.is_initialized():
            self.dims.build_mesh(self.device.type)
        self.dp_rank, self.dp_size = self.dims.dp_rank, self.dims.dp
        self.cp_rank, self.cp_size = self.dims.local_rank_on("cp"), self.dims.cp
        self.batch_schedule = batch_schedule_from_args(args)
        seed_everything(args.seed, pp_rank=self.dims.pp_rank, dp_rank=self.dp_rank,
                        data_parallel_random_init=args.data_parallel_random_init)

        self.tokenizer = build_tokenizer(args)
        print_time_to_initialize(self.device)
        self.setup_timers = SetupTimers(self.device)
        self.setup_timers.start("model-and-optimizer-setup")
        self.vocab_size = padded_vocab_size(self.tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                            args.tensor_model_parallel_size)
        self._found_checkpoint = checkpointing.find_checkpoint(
            args.load, args.ckpt_step, verify=not args.no_verify_checkpoint_checksums) \
            if args.load else None
        load = args.load
        if self._found_checkpoint is None and args.pretrained_checkpoint:  # Megatron: as --load DIR --finetune
            load, args.finetune = args.pretrained_checkpoint, True
            self._found_checkpoint = checkpointing.find_checkpoint(
                load, verify=not args.no_verify_checkpoint_checksums)
            if self._found_checkpoint is None:
                raise SystemExit(f"error: --pretrained-checkpoint {load}: no checkpoint found")
            print_rank0(f" note: starting from --pretrained-checkpoint {self._found_checkpoint}"
                        + (f" (--load {args.load} holds no checkpoint)" if args.load else ""))
        elif args.load and self._found_checkpoint is None and args.exit_on_missing_checkpoint:
            raise SystemExit(f"error: --load {args.load}: no complete checkpoint found "
                             "(--exit-on-missing-checkpoint)")
        if self._found_checkpoint:  # a checkpoint saved under another TP size may be padded differently
            self.vocab_size = checkpointing.resume_vocab_size(self._found_checkpoint, self.vocab_size,
                                                              self.tokenizer.vocab_size, args.tensor_model_parallel_size)
        try:
            self.model_config = self.family.config_from_args(args, self.vocab_size)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        if args.save_hf:
            hf_start.check_save_hf(args, self.family, self.model_config)
        self.objective = self.build_objective()
        if self.per_token_loss and len(self.objective.loss_names) > 1:
            raise SystemExit(f"error: --calculate-per-token-loss averages one loss over the global batch's loss "
                             f"tokens; the {self.family.name} objective has {len(self.objective.loss_names)} "
                             f"({', '.join(self.objective.loss_names)})")
        try:
            self.dims.validate_model(self.model_config, seq_length=args.seq_length)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        self.parallelized = self._build_model()
        if isinstance(self.parallelized.loss_head, ChunkedCrossEntropy):
            self.parallelized.loss_head.labeled_rows_only = self.objective.sparse_labels
        self.model = self.parallelized.model  # DDP wrapper or the (sharded) model itself
        self.module = self.parallelized.module  # the family's model, for its methods and state dicts
        self.grad_fusion = self.parallelized.grad_fusion
        # delayed fp8 scaling's histories (None without): agreed once per step, saved in checkpoints
        self.fp8_scaling = Fp8ScalingState.of(self.parallelized, self.run.parallelize.fp8_recipe,
                                              self.dims.replicas, lambda: self.dims.replica_mesh().get_group())
        # MoE models: expert-bias updates and logged values (None: dense, nothing to do)
        self.moe_metrics = MoEMetrics.for_model(self.module, self.model_config, device=self.device,
                                                per_token_loss=self.per_token_loss)
        # multi-token prediction: the depths' logged losses (None without depths)
        self.mtp_metrics = MtpMetrics.for_model(self.module, self.model_config, device=self.device,
                                                per_token_loss=self.per_token_loss)
        self.optimizer = self._build_optimizer()
        if self.grad_fusion is not None and isinstance(self.optimizer, KernelAdamW):
            self.grad_fusion.copier = self.optimizer  # its step writes the bf16 weight copies
        self.scheduler = LRScheduler(self.optimizer, self.run.lr_schedule)
        if args.fp16:
            self.scaler: Any = (ConstantLossScaler(args.loss_scale) if args.loss_scale else DynamicLossScaler(
                initial_scale=args.initial_loss_scale, min_scale=args.min_loss_scale,
                growth_interval=args.loss_scale_window, hysteresis=args.hysteresis))
        else:
            self.scaler = None
        self.state = TrainState()
        self._pending: _PendingStep | None = None
        self.interval = IntervalStats()  # the iterations settled since the last log line
        self.last_result: tuple[int, StepResult] | None = None  # the last settled iteration and its result
        self.flags_wait_s = 0.0  # time the host spent waiting for iterations' flags (benchmarks read it)
        self.flops_per_iteration = self.family.flops(self.model_config, args.global_batch_size, args.seq_length)
        self.peak_tflops = device_peak_tflops(self.device, self.precision.dtype)
        self.writer = MetricsWriter(args.tensorboard_dir, enabled=self._is_logging_rank(),
                                    wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name,
                                    wandb_save_dir=args.wandb_save_dir, run_config=vars(args))
        self.writer.log_config(vars(args))
        self.checkpointer = checkpointing.Checkpointer(async_save=args.async_save,
                                                       keep_last=args.keep_last_checkpoints,
                                                       verbose=get_rank() == 0)
        self.cuda_graphs = self._build_cuda_graphs()
        self.hf_copies = hf_start.HFCopies(args.save_hf, get_rank())
        self._rng_checkpoint: str | None = None
        if load:
            self._load(load)
        if self._found_checkpoint is None and self.family.start_parts is not None:
            start_parts(self.family.start_parts(args), self.module, verify=not args.no_verify_checkpoint_checksums)
        self.setup_timers.stop("model-and-optimizer-setup")
        print_datetime("after model, optimizer, and learning rate scheduler are built")
        self.setup_timers.start("train/valid/test-data-iterators-setup")
        self._build_data()
        self.setup_timers.stop("train/valid/test-data-iterators-setup")
        print_datetime("after dataloaders are built")
        if self._rng_checkpoint:  # last: building the data iterators draws from the RNG
            checkpointing.restore_rng(self._rng_checkpoint)

    # ------------------------------------------------------------------ set-up
    def _is_logging_rank(self) -> bool:
        return get_rank() == self.world_size - 1

    def _build_model(self) -> Parallelized:
        """Build on the meta device; TP/SP, recompute, compile, FSDP2/DDP; fill the weights (any layout)."""
        self.pipeline: Any = None
        if self.dims.pp > 1:  # this rank's pipeline stages, each parallelised like a model
            from megatrain.parallel.pipeline import PipelineParallel
            try:
                self.pipeline = PipelineParallel.build(
                    self.model_config, self.dims, self.run.parallelize, self.run.pipeline, device=self.device,
                    seed=self.args.seed, num_micro_batches=self.args.num_micro_batches, objective=self.objective,
                    family=self.family)
            except ValueError as e:
                raise SystemExit(f"error: {e}") from None
            self.pipeline.per_token_loss = self.per_token_loss
            p = self.pipeline
            return Parallelized(p.model, p.module, None, p.grad_fusion, p.fp8_report)
        with torch.device("meta"):
            model = self.family.build_model(self.model_config)
        return parallelize_model(model, self.dims, self.run.parallelize, device=self.device, seed=self.args.seed,
                                 family=self.family)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over this rank's trainable parameters. Under pipeline parallelism a rank whose
        stages have nothing to train (LLaVA's --freeze-LM: the language model's layers) gets one whose
        step does nothing, as long as another stage trains: it still runs its forward and backward
        (the activation gradients reach the first stage) and every collective of the step."""
        allow_empty = False
        if self.pipeline is not None:  # (trainable tensors of all stages, whether the first rank's has none)
            mine = sum(1 for p in self.module.parameters() if p.requires_grad)
            counts = torch.tensor([mine, int(mine == 0 and self.dims.pp_rank == 0)], dtype=torch.int64,
                                  device=self.device)
            dist.all_reduce(counts, group=self.pipeline.pp_group)
            total, first_empty = counts.tolist()
            if total and first_empty:  # on every rank alike; rank 0 writes a checkpoint's meta.json
                raise SystemExit("error: the first pipeline rank's stages have nothing to train while later stages "
                                 "do; its optimizer records a checkpoint's optimizer state: unfreeze a part it holds")
            allow_empty = total > 0
        return build_optimizer(self.module, self.run.optimizer, allow_empty=allow_empty, device=self.device)

    @staticmethod
    def _checkpoint_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
        """The optimizer whose state a checkpoint saves and loads on this rank: None where it holds no
        parameter (a frozen pipeline stage: its state is empty, the checkpoint's is the other ranks')."""
        return optimizer if any(g["params"] for g in optimizer.param_groups) else None

    def _build_cuda_graphs(self) -> MicroBatchGraphs | None:
        a = self.args
        if a.cuda_graph_impl != "local":
            return None
        if not self.objective.batches_in_cuda_graph:
            raise SystemExit(f"error: --cuda-graph-impl local: {type(self.objective).__name__} builds its batches "
                             "with host decisions (per-batch attention masks), which a recorded graph cannot hold")
        assert self.device.type == "cuda" and self.pipeline is None and self.world_size == 1, \
            "arguments.py refuses these"
        assert type(self.objective).host_batch is Objective.host_batch, "a graphed micro-batch skips host_batch"
        if self.grad_fusion is not None:
            self.grad_fusion.detach_embeddings()
        return MicroBatchGraphs(list(self.module.parameters()), self.device, a.cuda_graph_warmup_steps,
                                num_losses=len(self.objective.loss_names))

    def build_datasets(self, num_samples: list[int]) -> tuple[Any, Any, Any]:
        """Train/valid/test datasets (hook: fine-tuning returns its own; samples go to the objective):
        the family's, or Megatron's GPT token datasets."""
        a = self.args
        if self.family.datasets is not None:
            return self.family.datasets(a, self.tokenizer, num_samples)
        return build_train_valid_test_datasets(self.run.data, a.seq_length, a.seed, num_samples,
                                               self.tokenizer.vocab_size, self.tokenizer.eod)

    def build_objective(self) -> Any:
        """The family's objective (hook: fine-tuning returns its own)."""
        return self.family.objective(self.args, self.tokenizer)

    def checkpoint_extra(self) -> dict[str, Any]:
        """Plain JSON data saved in every checkpoint's meta.json (hook: a fine-tuning task's label names)."""
        return {}

    def _build_data(self) -> None:
        a = self.args
        num_samples = num_samples_for_splits(a.train_iters, a.train_samples, a.global_batch_size,
                                             a.eval_interval, a.eval_iters)
        self.train_ds, self.valid_ds, self.test_ds = self.build_datasets(num_samples)
        pin = self.device.type == "cuda"

        def loader(ds: Any, consumed: int) -> Iterator[torch.Tensor] | None:
            if ds is None:
                return None
            return iter(build_pretraining_data_loader(ds, consumed, a.micro_batch_size, self.dp_rank, self.dp_size,
                                                      a.num_workers, pin_memory=pin,
                                                      dataloader_type=a.dataloader_type or "single",
                                                      data_sharding=a.data_sharding))

        self.train_iter = loader(self.train_ds, self.state.consumed_train_samples)
        if self.family.batch_flops is not None and self.train_iter is not None:  # the log line counts what ran
            self.train_iter = CountedFlops(self.train_iter, self.family.batch_flops(a, self.model_config))
        # A split with no samples (BERT/T5 under --eval-iters 0 ask for none) gets no loader: its sampler
        # would refuse. Every other validation split keeps its loader even without evaluation, because
        # starting a loader draws its base seed from torch's global generator, and the dropout masks
        # (so the losses of runs and checkpoints made so far) follow from that generator's state.
        empty = self.valid_ds is not None and len(self.valid_ds) == 0
        self.valid_iter = None if empty else loader(self.valid_ds, self.state.consumed_valid_samples)

    def _load(self, load: str) -> None:
        a = self.args
        ckpt = self._found_checkpoint
        if ckpt is None:
            print_rank0(f"WARNING: no checkpoint found in --load {load}; starting from scratch")
            return
        # The schedule as Megatron restores it: not under --finetune or --no-load-optim; settled
        # first (a mismatch is refused before any tensor is read).
        saved_schedule = None if a.finetune or a.no_load_optim else checkpointing.read_meta(ckpt).get("scheduler")
        if saved_schedule is not None:
            try:
                notes = self.scheduler.load_state_dict(
                    saved_schedule, use_checkpoint=a.use_checkpoint_opt_param_scheduler,
                    override=a.override_opt_param_scheduler)
            except ValueError as e:
                raise SystemExit(f"error: --load {ckpt}: {e}") from None
            for note in notes:
                print_rank0(note)
        try:
            meta = checkpointing.load_checkpoint(ckpt, self.module, self._checkpoint_optimizer(self.optimizer),
                                                 load_optim=not (a.finetune or a.no_load_optim),
                                                 load_rng=False,
                                                 model_config=self.model_config, finetune=a.finetune,
                                                 allow_non_finite=a.allow_non_finite_checkpoint,
                                                 partial=self.pipeline is not None,
                                                 strictness=getattr(a, "dist_ckpt_strictness",
                                                                    checkpointing.DEFAULT_STRICTNESS))
        except checkpointing.CheckpointError as e:
            raise SystemExit(f"error: --load {load}: {e}") from None
        if not (a.finetune or a.no_load_rng):
            self._rng_checkpoint = ckpt
        if self.fp8_scaling is not None:  # (part of the model's state, as Transformer Engine's extra state)
            try:
                for note in self.fp8_scaling.load(meta, ckpt):
                    print_rank0(note)
            except ValueError as e:
                raise SystemExit(f"error: --load {e}") from None
        # Where the weights came from travels on: a model trained on from a Hugging Face import exports
        # back as its class, with its own vocabulary rows (not the padded embedding).
        for key in PROVENANCE_ARGS:
            if getattr(a, key, None) is None and (meta.get("args") or {}).get(key) is not None:
                setattr(a, key, meta["args"][key])
        if not a.finetune:
            ts = meta["train_state"]
            self.state = TrainState(**ts)
            if saved_schedule is not None:
                if a.override_opt_param_scheduler and self.scheduler.num_steps != self.state.consumed_train_samples:
                    # Megatron: under the override the schedule follows the consumed samples.
                    print_rank0(f" note: --override-opt_param-scheduler: the schedule's step count "
                                f"({self.scheduler.num_steps}) is set to the consumed samples "
                                f"({self.state.consumed_train_samples})")
                    self.scheduler.num_steps = self.state.consumed_train_samples
            # A loaded optimizer state brings the saved groups' lr bounds; the settled schedule's run.
            self.scheduler.apply_group_bounds()
            if self.scaler is not None and meta.get("loss_scaler") and not a.no_load_optim:
                self.scaler.load_state_dict(meta["loss_scaler"])
        print_rank0(f" loaded checkpoint from {ckpt} at iteration {meta['train_state']['iteration']}"
                    + (" (finetune: iteration and optimizer reset)" if a.finetune else ""))

    def save(self) -> None:
        a = self.args
        if not a.save:
            return
        extra = {"scheduler": self.scheduler.state_dict(),
                 "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
                 **self.checkpoint_extra(),
                 **(self.fp8_scaling.checkpoint_entry() if self.fp8_scaling is not None else {})}
        optimizer = self._checkpoint_optimizer(self.optimizer)
        report = self.checkpointer.save(a.save, self.state, self.module, optimizer, extra, a,
                                        self.model_config, save_optim=not a.no_save_optim,
                                        save_rng=not a.no_save_rng)
        if a.save_hf:  # from the complete checkpoint: a background save first finishes
            if report.asynchronous:
                self.checkpointer.wait()
            self.hf_copies.start(report.path)
        if report.asynchronous:
            print_rank0(f" saving checkpoint at iteration {self.state.iteration:7d} to {report.path} in the "
                        f"background (training loop blocked {report.blocked_s * 1000:.1f} ms)")
        else:
            print_rank0(f" saved checkpoint at iteration {self.state.iteration:7d} to {report.path} "
                        f"({report.blocked_s * 1000:.1f} ms)")

    # ------------------------------------------------------------------ the loop
    def _memory_estimate(self) -> Any:
        a = self.args
        if self.family.memory is None:
            return None
        return self.family.memory(
            self.model_config, seq_length=a.seq_length, micro_batch_size=a.micro_batch_size, tp=self.dims.tp,
            pp=self.dims.pp, dp=self.dims.dp, zero_stage=a.zero_stage, sequence_parallel=a.sequence_parallel,
            recompute_granularity=a.recompute_granularity, half_precision=self.precision.dtype != torch.float32,
            optimizer=a.optimizer, loss_chunked=bool(a.cross_entropy_chunk_size),
            num_micro_batches=a.num_micro_batches, cp=self.dims.cp, expert_parallel_size=self.dims.ep)

    def train(self) -> TrainState:
        a = self.args
        train_iters = a.train_iters_derived
        exits = ExitRequest(a, self.start_time, self.device)
        # Under pipeline parallelism the whole model's count (every rank takes part in the sum).
        n_params = self.pipeline.num_parameters() if self.pipeline is not None else self.module.num_parameters()
        print_rank0(f" training: {n_params:,} parameters, {train_iters} iterations, "
                    f"global batch {a.global_batch_size} = micro-batch {a.micro_batch_size} x "
                    f"{a.num_micro_batches} micro-batches x {self.dp_size} data-parallel, {self.precision.name} "
                    f"on {self.device}" + (f"; {self.dims.describe()}" if self.world_size > 1 else ""))
        if self.batch_schedule is not None:
            length = f"{a.train_samples:,} samples" if a.train_samples else "--train-iters"
            print_rank0(f" {self.batch_schedule.describe()} ({train_iters} iterations for {length})")
        estimate = self._memory_estimate()
        if estimate is not None:
            print_rank0(f" {estimate.line()}")
        fusion = self.grad_fusion
        if fusion is not None:
            n_fp8 = len(fusion.fp8_linears)
            copies = (f"copies ({len(fusion.slots) - n_fp8} {self.precision.name}, {n_fp8} fp8)" if n_fp8
                      else f"{self.precision.name} copies")
            print_rank0(f" gradient-accumulation fusion: {len(fusion.slots)} weights compute from {copies} refreshed "
                        "once per step and add their gradients into the fp32 .grad inside the weight-gradient matmul "
                        "(--no-gradient-accumulation-fusion turns it off)")
        if isinstance(self.optimizer, KernelAdamW):
            copies = ", the half-precision weight copies written in the same pass" if fusion is not None else ""
            why = ("MEGATRAIN_ADAMW_KERNEL=1" if self.run.optimizer.adamw_kernel
                   else f"the default on CUDA from {KERNEL_ADAMW_MIN_PARAMETERS:,} trained parameters; "
                        "MEGATRAIN_ADAMW_KERNEL=0 turns it off")
            print_rank0(f" AdamW: megatrain's Triton kernel ({why}): the clipping divisor "
                        f"applied without writing the gradients back{copies}")
        elif self.run.optimizer.adamw_kernel:  # MEGATRAIN_ADAMW_KERNEL=1 that does not apply
            print_rank0(f" AdamW: {type(self.optimizer).__name__} from torch (MEGATRAIN_ADAMW_KERNEL=1 applies "
                        "to float32 parameters, not sharded, with AdamW on a device Triton runs on)")
        fp8 = self.parallelized.fp8_report
        if fp8 is not None:
            converted, kept = fp8
            backend = ("megatrain's, weights cast once per step" if fusion is not None and fusion.fp8_linears
                       else "torchao")
            recipe = self.run.parallelize.fp8_recipe
            fp8_head = getattr(self.parallelized.loss_head, "fp8_weights", None) is not None
            if self.run.parallelize.fp8_output_layer and not fp8_head:
                print_rank0(" note: MEGATRAIN_FP8_OUTPUT_LAYER=1 applies with megatrain's fp8 layers and the chunked "
                            "loss head (no bias, sizes multiples of 16): the output layer stays bf16")
            scaling = recipe.describe() if backend != "torchao" else "tensorwise scaling"
            if recipe.delayed and backend == "torchao":
                print_rank0(" note: --fp8-recipe delayed: torchao's fp8 layers (under TP, PP, FSDP2 or "
                            "MEGATRAIN_FP8_BACKEND=torchao) scale tensorwise")
            print_rank0(f" fp8 ({a.fp8_format}: e4m3 forward, {'e5m2' if a.fp8_format == 'hybrid' else 'e4m3'} "
                        f"gradients; per-tensor {scaling}; {backend}): {len(converted)} linear "
                        "layers of the transformer layers run fp8 matmuls"
                        + (" (on this rank's pipeline stages)" if self.dims.pp > 1 else "")
                        + ("; the output layer too (MEGATRAIN_FP8_OUTPUT_LAYER=1, tensorwise)" if fp8_head
                           else "; the output layer stays bf16")
                        + (f"; kept in bf16 (sizes not multiples of 16): {', '.join(kept)}" if kept else ""))
        self.interval = IntervalStats()
        t_last = time.time()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.housekeeping.start()
        deferred_log = False  # the last iteration's log line waits for the next one's work to be queued
        while self.state.iteration < train_iters:
            self.housekeeping.before_iteration(self.state.iteration)
            if self.batch_schedule is not None:
                self.num_micro_batches = self.batch_schedule.micro_batches_at(self.state.consumed_train_samples)
                if self.pipeline is not None:
                    self.pipeline.set_num_micro_batches(self.num_micro_batches)
            self.queue_step()  # settles the previous iteration; this one may stay pending
            if deferred_log:  # the previous iteration is settled, this one's forward and backward are queued
                self._log_line(t_last, train_iters, estimate, {}, {})
                t_last, deferred_log = time.time(), False
            self.state.iteration += 1
            self.housekeeping.after_optimizer_step(self.state.iteration)
            self.state.consumed_train_samples += self.current_global_batch_size
            it = self.state.iteration
            tensorboard = self.writer.active and it % a.tensorboard_log_interval == 0
            log = it % a.log_interval == 0
            evaluate = bool(a.eval_interval and it % a.eval_interval == 0 and self.valid_iter is not None)
            save = bool(a.save and a.save_interval and it % a.save_interval == 0)
            # A log line alone does not make the host wait for this iteration: it is printed once the next
            # iteration's forward and backward are queued (the host's logging overlaps them), unless MoE or
            # multi-token prediction values (summed on the device per iteration) are to be read with it.
            defer = (log and not (tensorboard or evaluate or save or it == train_iters) and self._pending is not None
                     and self.moe_metrics is None and self.mtp_metrics is None)
            if (tensorboard or log or evaluate or save or it == train_iters) and not defer:
                self.settle()  # what follows reads this iteration's result or the schedule after it
            moe_reports = self._read_moe(it, log) if self.moe_metrics is not None else {}
            if "last" in moe_reports:
                self._write_moe_tensorboard(it, moe_reports["last"])
            mtp_losses = self._read_mtp() if log and self.mtp_metrics is not None else {}
            if self.writer.active:
                for name, value in mtp_losses.items():
                    self.writer.add_scalar(name, value, it)
            if tensorboard:
                assert self.last_result is not None and self.last_result[0] == it
                result = self.last_result[1]
                self.writer.log_train(it, consumed_samples=self.state.consumed_train_samples,
                                      losses=result.losses, learning_rate=self.scheduler.current_lr(),
                                      batch_size=self.current_global_batch_size, grad_norm=result.grad_norm,
                                      num_zeros=result.num_zeros, params_norm=result.params_norm,
                                      loss_scale=float(self.scaler.scale) if self.scaler is not None else None)
            if defer:
                deferred_log = True
            elif log:
                self._log_line(t_last, train_iters, estimate, moe_reports, mtp_losses)
                t_last = time.time()
            self._stop_on_nan_iterations()
            if evaluate:
                self.evaluate_and_print(f"iteration {it}", self.valid_iter, it)
                t_last = time.time()
            if save:
                self.save()
                t_last = time.time()
            reason = exits.reason(it)
            if reason:
                self.settle()
                if deferred_log:
                    self._log_line(t_last, train_iters, estimate, {}, {})
                print_rank_last(f" {reason}")
                if a.save and not save:
                    self.save()
                self.close()
                sys.exit(0)
        return self.state

    def _log_line(self, t_last: float, train_iters: int, estimate: Any, moe_reports: dict[str, MoEReport],
                  mtp_losses: dict[str, float]) -> None:
        """Print the log interval's line (its iterations settled), then start the next interval. The
        host waited for the interval's last flags, so the time between two log lines is the iterations'
        time (an optimizer step still running on the GPU is counted in the next interval)."""
        now = time.time()
        self._log(self.interval, (now - t_last) / self.interval.iterations, train_iters,
                  moe=moe_reports.get("interval"), mtp=mtp_losses)
        self.housekeeping.after_log()
        if self.device.type == "cuda" and self.state.iteration == self.args.log_interval:
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            theory = f" (theoretical {estimate.total / 2**30:.2f} GiB)" if estimate is not None else ""
            print(f" [rank {get_rank()}] measured peak memory after {self.state.iteration} iterations: "
                  f"{peak:.2f} GiB{theory}", flush=True)
        self.interval = IntervalStats()

    @property
    def current_global_batch_size(self) -> int:
        """The global batch of the current iteration (below --global-batch-size during a ramp-up)."""
        return self.num_micro_batches * self.args.micro_batch_size * self.dp_size

    def _read_moe(self, iteration: int, log: bool) -> dict[str, MoEReport]:
        """The MoE values the log line (``"interval"``) and TensorBoard (``"last"``: every
        --tensorboard-log-interval iterations, Megatron writes them each iteration) show at this
        iteration, reduced over the ranks: every rank reads (the same decision everywhere)."""
        a = self.args
        metrics_on = bool(a.tensorboard_dir or a.wandb_project)  # the same on every rank (the writer is not)
        last = metrics_on and iteration % a.tensorboard_log_interval == 0
        if not (last or log):
            return {}
        assert self.moe_metrics is not None
        pp_group = self.pipeline.pp_group if self.pipeline is not None else None
        dp_group = self.dims.submesh("dp").get_group() if self.dp_size > 1 else None
        return self.moe_metrics.read(last=last, interval=log, pp_group=pp_group, dp_group=dp_group)

    def _read_mtp(self) -> dict[str, float]:
        """The log interval's multi-token prediction losses, reduced over the ranks (every rank reads):
        the context-parallel parts and pipeline stages summed, the data-parallel ranks averaged."""
        assert self.mtp_metrics is not None

        def reduce(values: torch.Tensor) -> torch.Tensor:
            values = self._dp_mean(self._cp_sum(values))
            if self.pipeline is not None and self.pipeline.pp_group is not None:
                torch.distributed.all_reduce(values, group=self.pipeline.pp_group)  # the last stage's
            return values

        return self.mtp_metrics.read(reduce)

    def _write_moe_tensorboard(self, iteration: int, report: MoEReport) -> None:
        """Megatron's MoE scalars: each value by its name, and with --moe-per-layer-logging
        ``moe/<name>_layer_<i>`` for every layer."""
        if not self.writer.active:
            return
        for name, value in report.averages.items():
            self.writer.add_scalar(name, value, iteration)
        if getattr(self.args, "moe_per_layer_logging", False):
            for name, values in report.per_layer.items():
                for i, value in enumerate(values):
                    self.writer.add_scalar(f"moe/{name}_layer_{i}", value, iteration)

    def _iteration_flops(self, stats: IntervalStats) -> float:
        """The model FLOPs of one iteration of the log interval: the family's formula for the current
        global batch or, where the family counts its micro-batches (``batch_flops``), the mean over the
        interval's iterations of what the data-parallel ranks read (one sum over them per log line)."""
        if not isinstance(self.train_iter, CountedFlops):
            return self.flops_per_iteration * self.current_global_batch_size / self.args.global_batch_size
        flops = self.train_iter.take()
        if self.dp_size > 1:
            total = torch.tensor([flops], dtype=torch.float64, device=self.device)
            flops = float(summed(total, self.dp_size, lambda: self.dims.submesh("dp")).item())
        return flops / max(stats.iterations, 1)

    def _log(self, stats: IntervalStats, seconds_per_iter: float, train_iters: int,
             moe: MoEReport | None = None, mtp: dict[str, float] | None = None) -> None:
        a = self.args
        batch = self.current_global_batch_size
        tflops = self._iteration_flops(stats) / (seconds_per_iter * 1e12 * self.world_size)
        tokens_per_gpu = batch * a.seq_length / seconds_per_iter / self.world_size
        mem_gib = (torch.cuda.max_memory_allocated(self.device) / 2**30) if self.device.type == "cuda" else None
        mfu = tflops / self.peak_tflops if self.peak_tflops else None
        losses = stats.mean_losses(self.objective.loss_names[:1] if self.per_token_loss else self.objective.loss_names)
        if moe is not None:  # after the objective's losses, as Megatron's total_loss_dict
            losses = {**losses, **moe.averages}
        if mtp:  # then multi-token prediction's
            losses = {**losses, **mtp}
        line = format_train_log_line(
            iteration=self.state.iteration, train_iters=train_iters,
            consumed_samples=self.state.consumed_train_samples, elapsed_ms=seconds_per_iter * 1000.0,
            throughput_tflops=tflops, learning_rate=self.scheduler.current_lr(),
            global_batch_size=batch, losses=losses,
            loss_scale=float(self.scaler.scale) if self.scaler is not None else 1.0,
            grad_norm=stats.last_grad_norm, num_zeros=stats.last_num_zeros, params_norm=stats.last_params_norm,
            skipped_iterations=stats.skipped, nan_iterations=stats.nan, tokens_per_sec_per_gpu=tokens_per_gpu,
            mfu=mfu, peak_mem_gib=mem_gib)
        print_rank_last(line)
        self.writer.log_train(self.state.iteration, consumed_samples=self.state.consumed_train_samples,
                              throughput_tflops=tflops, iteration_time_s=seconds_per_iter,
                              tokens_per_sec_per_gpu=tokens_per_gpu, mfu=mfu,
                              memory={"mem-max-allocated-bytes": mem_gib * 2**30} if mem_gib is not None else None)

    def close(self) -> None:
        """Finish a background checkpoint save (it must complete before exit), close the writers,
        release the --save lock."""
        try:
            self.housekeeping.close()
            self.checkpointer.close()
            self.hf_copies.close()
            self.writer.close()
        finally:
            if self._save_lock is not None:
                self._save_lock.release()


def pretrain(args: argparse.Namespace, trainer_class: type[Trainer] = Trainer,
             family: str | ModelFamily = DEFAULT_FAMILY) -> TrainState:
    """Build everything from parsed arguments for a model ``family``, train, evaluate at the end, save
    (Megatron's ``pretrain``; the family stands for its model, dataset and forward-step providers)."""
    setup_logging(getattr(args, "logging_level", None))
    for note in args.legacy_notes:
        print_rank0(note)
    trainer = trainer_class(args, family=family)
    finished = False
    try:
        print_rank0("done with setup ...")
        trainer.setup_timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"])
        if not args.skip_train:
            print_rank0("training ...")
            print_datetime("before the start of training step")
            trainer.train()
            print_datetime("after training is done")
        it = trainer.state.iteration
        if args.save and (not args.save_interval or it % args.save_interval != 0) and not args.skip_train:
            trainer.save()
        if trainer.valid_ds is not None and args.eval_iters > 0:
            trainer.evaluate_and_print(f"iteration {it} on validation set", trainer.valid_iter, it)
        if trainer.test_ds is not None and args.eval_iters > 0:
            test_iter = iter(build_pretraining_data_loader(trainer.test_ds, 0, args.micro_batch_size,
                                                           trainer.dp_rank, trainer.dp_size, 0))
            trainer.evaluate_and_print(f"iteration {it} on test set", test_iter, it)
        finished = True
    finally:
        trainer.close()
        state = trainer.state
        del trainer  # the model and its process groups must be unreachable before they are destroyed
        destroy_distributed(synchronize=finished)
    return state
