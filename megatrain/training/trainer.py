"""The pre-training loop: micro-batches, optimizer steps, evaluation, logging, exits and checkpoints.

`pretrain(args)` is what ``pretrain_gpt.py`` calls. The loop follows Megatron-LM: each
iteration consumes one global batch split into micro-batches (gradient accumulation), the
loss of a micro-batch is the mean over its unmasked tokens and the iteration's loss the mean
over micro-batches; the learning-rate schedule advances by the global batch size in samples.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatrain.checkpoint.save_lock import take_save_lock
from megatrain.data.batch import make_batch
from megatrain.data.config import DataConfig
from megatrain.data.gpt_dataset import build_train_valid_test_datasets, num_samples_for_splits
from megatrain.data.loader import build_pretraining_data_loader
from megatrain.data.tokenizers import build_tokenizer
from megatrain.models.gpt import GPTModel
from megatrain.parallel.context_parallel import split_batch
from megatrain.parallel.data_parallel import gradient_sync, unwrap
from megatrain.parallel.dims import ParallelDims
from megatrain.parallel.distributed import (destroy_distributed, get_rank, get_world_size, init_distributed,
                                            init_single_process_group)
from megatrain.parallel.parallelize import parallelize_gpt
from megatrain.parallel.random import seed_everything
from megatrain import checkpoint as checkpointing
from megatrain.training.batch_rampup import BatchRampup
from megatrain.training.builders import Precision, choose_device, model_config_from_args, padded_vocab_size
from megatrain.checkpoint import TrainState
from megatrain.runtime.cuda_graph import MicroBatchGraphs
from megatrain.training.flops import device_peak_tflops, num_floating_point_operations
from megatrain.training.housekeeping import Housekeeping
from megatrain.training.logging import (MetricsWriter, format_train_log_line, format_validation_block,
                                        format_validation_line)
from megatrain.training.loss_scaler import (ConstantLossScaler, DynamicLossScaler, found_inf_in_grads,
                                            reduce_found_inf, unscale_grads_)
from megatrain.training.lr_schedule import LRScheduler, lr_schedule_config_from_args
from megatrain.training.memory_report import MemoryEstimate, estimate_memory
from megatrain.training.optimizer import OptimizerConfig, build_optimizer, clip_grad_norm_, scale_grads_


def _print_line(*a: Any) -> None:
    """One write per message, so lines of several ranks sharing a stream never interleave mid-line."""
    sys.stdout.write(" ".join(str(x) for x in a) + "\n")
    sys.stdout.flush()


def print_rank0(*a: Any) -> None:
    if get_rank() == 0:
        _print_line(*a)


def print_rank_last(*a: Any) -> None:
    """Megatron prints training and validation lines from the last rank (it holds the loss under PP)."""
    if get_rank() == get_world_size() - 1:
        _print_line(*a)


class ExitRequest:
    """Collects the reasons to stop early: SIGTERM (with --exit-signal-handler), duration, interval.

    SIGTERM may reach only some ranks and clocks differ, so in a multi-process job the signal and
    duration flags are combined over all ranks every iteration (one tiny all-reduce, only when those
    flags are used): every rank stops, and saves, at the same iteration.
    """

    def __init__(self, args: argparse.Namespace, start_time: float, device: torch.device):
        self.args = args
        self.start_time = start_time
        self.device = device
        self.signal_received = False
        if args.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signal_received = True

    def reason(self, iteration: int) -> str | None:
        minutes = (time.time() - self.start_time) / 60.0
        limit = self.args.exit_duration_in_mins
        signalled, out_of_time = self.signal_received, limit is not None and minutes > limit
        if get_world_size() > 1 and (self.args.exit_signal_handler or limit is not None):
            flags = torch.tensor([float(signalled), float(out_of_time)], device=self.device)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            signalled, out_of_time = (bool(v) for v in flags.tolist())
        if signalled:
            return "received SIGTERM"
        if out_of_time:
            return f"exiting after {minutes:.2f} minutes (--exit-duration-in-mins)"
        if self.args.exit_interval and iteration % self.args.exit_interval == 0:
            return f"exiting at iteration {iteration} (--exit-interval)"
        return None


@dataclass
class StepResult:
    loss: float  # mean loss of the global batch
    grad_norm: float | None
    skipped: bool
    nan: bool


@dataclass
class _PendingStep:
    """An iteration queued on the device whose flags the host has not read yet."""
    iteration: int  # 1-based
    flags: torch.Tensor  # (overflow, loss finite, norm, loss); on the host, or arriving there when ready is set
    ready: Any  # torch.cuda.Event recorded after the flags' copy, or None
    has_norm: bool
    host_steps: bool  # the optimizer step waits for the host's decision (not queued yet)
    global_batch_size: int


class Trainer:
    """Owns the model, optimizer, schedule, scaler, data iterators and counters of one run."""

    # Whether make_batch is device work only (no host synchronisation), so that a CUDA graph of the
    # micro-batch can hold it (--cuda-graph-impl local).
    batches_in_cuda_graph = True

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.start_time = time.time()
        self.device = choose_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.precision = Precision.from_args(args)
        self.housekeeping = Housekeeping(args, self.device, int(os.environ.get("RANK", "0")))
        self.per_token_loss = bool(getattr(args, "calculate_per_token_loss", False))
        self.rampup: BatchRampup | None = None
        self.num_micro_batches = args.num_micro_batches  # of the current iteration (--rampup-batch-size)
        self.world_size = init_distributed(self.device, args.distributed_timeout_minutes).world_size
        if self.world_size != getattr(args, "world_size_actual", self.world_size):
            raise SystemExit(f"error: the arguments were checked for a world size of {args.world_size_actual} but the "
                             f"launcher started {self.world_size} processes; set WORLD_SIZE before parsing (torchrun "
                             f"does; under srun call megatrain.parallel.distributed.setup_env_from_slurm first)")
        # Before anything is written to --save: one run at a time writes there (held until close()).
        self._save_lock = take_save_lock(args.save) if args.save else None
        try:
            self.dims = ParallelDims.from_args(args, self.world_size)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        if self.world_size == 1 and args.zero_stage > 0:  # FSDP2 over one rank needs a mesh
            init_single_process_group(self.device)
        if dist.is_initialized():
            self.dims.build_mesh(self.device.type)
        self.dp_rank, self.dp_size = self.dims.dp_rank, self.dims.dp
        self.cp_rank, self.cp_size = self.dims.local_rank_on("cp"), self.dims.cp
        if getattr(args, "rampup_batch_size", None):
            self.rampup = BatchRampup(*args.rampup_batch_size, args.global_batch_size,
                                      args.micro_batch_size * self.dp_size)
        seed_everything(args.seed, pp_rank=self.dims.pp_rank, dp_rank=self.dp_rank,
                        data_parallel_random_init=bool(getattr(args, "data_parallel_random_init", False)))

        self.tokenizer = build_tokenizer(args)
        self.vocab_size = padded_vocab_size(self.tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                            args.tensor_model_parallel_size)
        self._found_checkpoint = checkpointing.find_checkpoint(
            args.load, args.ckpt_step, verify=not getattr(args, "no_verify_checkpoint_checksums", False)) \
            if args.load else None
        if args.load and self._found_checkpoint is None and getattr(args, "exit_on_missing_checkpoint", False):
            raise SystemExit(f"error: --load {args.load}: no complete checkpoint found "
                             "(--exit-on-missing-checkpoint)")
        if self._found_checkpoint:  # a checkpoint saved under another TP size may be padded differently
            self.vocab_size = checkpointing.resume_vocab_size(self._found_checkpoint, self.vocab_size,
                                                              self.tokenizer.vocab_size, args.tensor_model_parallel_size)
        self.model_config = model_config_from_args(args, self.vocab_size)
        try:
            self.dims.validate_model(self.model_config, seq_length=args.seq_length)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        self.model = self._build_model()  # DDP wrapper or the (sharded) model itself
        self.module = unwrap(self.model)  # the GPTModel, for its methods and state dicts
        self.optimizer = build_optimizer(self.module, OptimizerConfig(
            optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, sgd_momentum=args.sgd_momentum,
            decoupled_lr=getattr(args, "decoupled_lr", None), decoupled_min_lr=getattr(args, "decoupled_min_lr", None)))
        self.scheduler = LRScheduler(self.optimizer, lr_schedule_config_from_args(args))
        if args.fp16:
            self.scaler: Any = (ConstantLossScaler(args.loss_scale) if args.loss_scale else DynamicLossScaler(
                initial_scale=args.initial_loss_scale, min_scale=args.min_loss_scale,
                growth_interval=args.loss_scale_window, hysteresis=args.hysteresis))
        else:
            self.scaler = None
        self.state = TrainState()
        self._pending: _PendingStep | None = None
        self.interval = _IntervalStats()  # the iterations settled since the last log line
        self.last_result: tuple[int, StepResult] | None = None  # the last settled iteration and its result
        self.flags_wait_s = 0.0  # time the host spent waiting for iterations' flags (benchmarks read it)
        self.flops_per_iteration = num_floating_point_operations(
            self.model_config, args.global_batch_size, args.seq_length)
        self.peak_tflops = device_peak_tflops(self.device, self.precision.dtype)
        self.writer = MetricsWriter(args.tensorboard_dir, enabled=self._is_logging_rank(),
                                    wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name,
                                    wandb_save_dir=args.wandb_save_dir, run_config=vars(args))
        self.writer.log_config(vars(args))
        self.checkpointer = checkpointing.Checkpointer(async_save=bool(getattr(args, "async_save", False)),
                                                       keep_last=getattr(args, "keep_last_checkpoints", None),
                                                       verbose=get_rank() == 0)
        self.cuda_graphs = self._build_cuda_graphs()
        self._rng_checkpoint: str | None = None
        if args.load:
            self._load(args.load)
        self._build_data()
        if self._rng_checkpoint:  # last: building the data iterators draws from the RNG
            checkpointing.restore_rng(self._rng_checkpoint)

    # ------------------------------------------------------------------ set-up
    def _is_logging_rank(self) -> bool:
        return get_rank() == self.world_size - 1

    def _build_model(self) -> torch.nn.Module:
        """Build on the meta device; TP/SP, recompute, compile, FSDP2/DDP; fill the weights (any layout)."""
        self.pipeline: Any = None
        if self.dims.pp > 1:  # this rank's pipeline stages, each parallelised like a model
            from megatrain.parallel.pipeline import PipelineConfig, PipelineParallel
            try:
                self.pipeline = PipelineParallel.build(
                    self.model_config, self.dims, self.args, PipelineConfig.from_args(self.args), device=self.device,
                    seed=self.args.seed, num_micro_batches=self.args.num_micro_batches)
            except ValueError as e:
                raise SystemExit(f"error: {e}") from None
            self.pipeline.per_token_loss = self.per_token_loss
            return self.pipeline.model
        with torch.device("meta"):
            model = GPTModel(self.model_config)
        return parallelize_gpt(model, self.dims, self.args, device=self.device, seed=self.args.seed)

    def _build_cuda_graphs(self) -> MicroBatchGraphs | None:
        a = self.args
        if getattr(a, "cuda_graph_impl", "none") != "local":
            return None
        if not self.batches_in_cuda_graph:
            raise SystemExit(f"error: --cuda-graph-impl local: {type(self).__name__} builds its batches with host "
                             "decisions (per-batch attention masks), which a recorded graph cannot hold")
        assert self.device.type == "cuda" and self.pipeline is None and self.world_size == 1, \
            "arguments.py refuses these"
        return MicroBatchGraphs(list(self.module.parameters()), self.device, a.cuda_graph_warmup_steps)

    def build_datasets(self, num_samples: list[int]) -> tuple[Any, Any, Any]:
        """Train/valid/test datasets (hook: fine-tuning returns its own; samples go to ``make_batch``)."""
        a = self.args
        return build_train_valid_test_datasets(DataConfig.from_args(a), a.seq_length, a.seed, num_samples,
                                               self.tokenizer.vocab_size, self.tokenizer.eod)

    def make_batch(self, samples: torch.Tensor) -> dict[str, Any]:
        """Model inputs and loss mask from a collated micro-batch on the device (hook for fine-tuning)."""
        a = self.args
        return make_batch(samples, self.tokenizer.eod, a.reset_position_ids, a.reset_attention_mask,
                          a.eod_mask_loss)

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
                                                      dataloader_type=getattr(a, "dataloader_type", None) or "single",
                                                      data_sharding=getattr(a, "data_sharding", True)))

        self.train_iter = loader(self.train_ds, self.state.consumed_train_samples)
        self.valid_iter = loader(self.valid_ds, self.state.consumed_valid_samples)

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
            meta = checkpointing.load_checkpoint(ckpt, self.module, self.optimizer,
                                                 load_optim=not (a.finetune or a.no_load_optim),
                                                 load_rng=False,
                                                 model_config=self.model_config, finetune=a.finetune,
                                                 allow_non_finite=getattr(a, "allow_non_finite_checkpoint", False))
        except checkpointing.CheckpointError as e:
            raise SystemExit(f"error: --load {load}: {e}") from None
        if not (a.finetune or a.no_load_rng):
            self._rng_checkpoint = ckpt
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
                 "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None}
        report = self.checkpointer.save(a.save, self.state, self.module, self.optimizer, extra, a,
                                        self.model_config, save_optim=not a.no_save_optim,
                                        save_rng=not a.no_save_rng)
        if report.asynchronous:
            print_rank0(f" saving checkpoint at iteration {self.state.iteration:7d} to {report.path} in the "
                        f"background (training loop blocked {report.blocked_s * 1000:.1f} ms)")
        else:
            print_rank0(f" saved checkpoint at iteration {self.state.iteration:7d} to {report.path} "
                        f"({report.blocked_s * 1000:.1f} ms)")

    # ------------------------------------------------------------------ one step
    def _rank_batch(self, samples: torch.Tensor) -> dict[str, Any]:
        """Model inputs of one micro-batch on the device; with context parallelism, this rank's part."""
        b = self.make_batch(samples.to(self.device, non_blocking=True))
        return split_batch(b, self.cp_size, self.cp_rank) if self.cp_size > 1 else b

    def _forward_loss_sum(self, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the per-token losses where the loss mask is set, number of such tokens), over this
        rank's tokens (with context parallelism, its part of each sequence)."""
        return self._batch_loss_sum(self._rank_batch(samples))

    def _batch_loss_sum(self, b: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_forward_loss_sum` of a micro-batch already on the device (:meth:`_rank_batch`)."""
        with self.precision.autocast(self.device):
            per_token = self.model(b["tokens"], position_ids=b["position_ids"], attention_mask=b["attention_mask"],
                                   labels=b["labels"])
        mask = b["loss_mask"].to(per_token.dtype)
        return (per_token * mask).sum(), mask.sum()

    def _forward_loss(self, samples: torch.Tensor) -> torch.Tensor:
        """The micro-batch's mean loss over its loss tokens (with context parallelism, this rank's
        share of it: its tokens' loss over the whole sequence's token count; the shares sum to it)."""
        return self._mean_loss(*self._forward_loss_sum(samples))

    def _mean_loss(self, loss_sum: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return loss_sum / self._cp_sum(tokens.detach()).clamp(min=1.0)

    def _micro_batch_loss(self, loss_sum: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """What a training micro-batch back-propagates (times :meth:`_micro_batch_weight`): the loss
        sum with --calculate-per-token-loss (divided by the global token count after the backward),
        else :meth:`_forward_loss`'s mean."""
        return loss_sum if self.per_token_loss else self._mean_loss(loss_sum, tokens)

    def _micro_batch_weight(self, scale: float) -> float:
        """The factor on a micro-batch's loss in its backward: the loss scale and, for mean losses,
        1 / micro-batches (x cp: the gradient reduction averages over data x context parallel ranks)."""
        return scale if self.per_token_loss else scale * self.cp_size / self.num_micro_batches

    def _micro_batch_backward(self, batch: dict[str, Any], weight: float, fusion: Any, hold_others: bool,
                              prefetch: Any = None) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Forward and backward of one training micro-batch, its gradients added to those so far:
        (its loss, its loss-token count, ``prefetch()``'s result, called before the backward so that
        the next micro-batch's inputs are queued first)."""
        if fusion is not None:  # the gradients so far become the matmuls' addends
            fusion.stage(hold_others=hold_others)
        loss_sum, n = self._batch_loss_sum(batch)
        if fusion is not None:
            fusion.release()
        fetched = prefetch() if prefetch is not None else None
        loss = self._micro_batch_loss(loss_sum, n)
        (loss * weight).backward()
        if fusion is not None:
            fusion.merge_held()
        return loss.detach(), n.detach(), fetched

    def _graphed_micro_batch(self, samples: torch.Tensor, weight: float, totals: torch.Tensor) -> None:
        """One micro-batch as its CUDA graph records it: batch, forward, backward, the loss and the
        loss-token count added into ``totals`` (see :mod:`megatrain.runtime.cuda_graph`)."""
        fusion = getattr(self.module, "grad_accumulation_fusion", None)
        loss, n, _ = self._micro_batch_backward(self.make_batch(samples), weight, fusion, hold_others=True)
        totals += torch.stack([loss, n])

    def _micro_batches(self, data_iter: Iterator[torch.Tensor]) -> list[dict[str, Any]]:
        """One iteration's micro-batches as model inputs (pipeline parallel runs them all at once)."""
        return [self._rank_batch(next(data_iter)) for _ in range(self.num_micro_batches)]

    def _grad_fusion(self) -> Any:
        """The model's gradient-accumulation fusion with its half-precision weights refreshed, or None."""
        fusion = getattr(self.module, "grad_accumulation_fusion", None)
        if fusion is not None:
            fusion.refresh()
        return fusion

    def _micro_batches_backward(self, fusion: Any, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of the iteration's micro-batches, the gradients summed over them
        (reduced over data-parallel ranks after the last); (sum of their losses, their loss-token count
        with --calculate-per-token-loss, else zero)."""
        assert self.train_iter is not None
        total = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device)
        weight = self._micro_batch_weight(scale)
        train_iter = self.train_iter
        batch = self._rank_batch(next(train_iter))
        for i in range(self.num_micro_batches):
            last = i == self.num_micro_batches - 1
            # Data-parallel gradient reduction only after the last micro-batch, which therefore
            # cannot hold gradients aside (the reduction reads those autograd accumulates).
            with gradient_sync(self.model, last):
                loss, n, batch = self._micro_batch_backward(
                    batch, weight, fusion, hold_others=not (last and self.dims.replicas > 1),
                    prefetch=None if last else lambda: self._rank_batch(next(train_iter)))
            total += loss
            if self.per_token_loss:  # only the per-token loss reads the count
                tokens += n
        return total, tokens

    def train_step(self) -> StepResult:
        """One iteration, finished: its result, with the LR schedule (and loss scale) advanced."""
        self.queue_step()
        self.settle()
        assert self.last_result is not None and self._pending is None
        return self.last_result[1]

    def queue_step(self) -> None:
        """Queue one iteration: forward and backward of its micro-batches, gradient clipping and,
        where the device can skip it by itself, the optimizer step; the iteration's flags (overflow,
        loss finite, norm, loss) travel to the host behind it.

        Where the step does not need the host's decision (fused optimizer kernels on CUDA, no loss
        scaling), the iteration is left *pending*: the host reads its flags only when the next
        iteration's optimizer step is about to be queued (the LR schedule must have advanced by
        then) or when the training loop needs the result (log line, checkpoint, evaluation), so that
        the host prepares the next iteration while the device still runs this one. Otherwise it is
        settled here."""
        a = self.args
        assert self.train_iter is not None
        self.model.train()
        graphs = self.cuda_graphs
        if graphs is not None:
            graphs.begin_iteration(lambda: self.optimizer.zero_grad(set_to_none=True))
        else:
            self.optimizer.zero_grad(set_to_none=True)
        fusion = self._grad_fusion()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.pipeline is not None:  # all micro-batches through the pipeline schedule
            total = self.pipeline.train_step(self._micro_batches(self.train_iter), loss_scale=scale,
                                             autocast=self.precision.autocast(self.device))
            tokens = self.pipeline.token_count_on_all_ranks() if self.per_token_loss else torch.zeros_like(total)
        elif graphs is not None and not graphs.warming_up:  # each micro-batch one replay of its graph
            weight = self._micro_batch_weight(scale)
            for _ in range(self.num_micro_batches):
                graphs.run(next(self.train_iter), weight, self._graphed_micro_batch)
            total, tokens = graphs.totals.unbind()
        else:
            with graphs.warmup_stream() if graphs is not None else contextlib.nullcontext():
                total, tokens = self._micro_batches_backward(fusion, scale)
        if graphs is not None:
            graphs.end_iteration()
        self.housekeeping.after_forward_backward()
        params = [p for p in self.module.parameters() if p.grad is not None]
        per_token_mean = None
        if self.per_token_loss:
            # --calculate-per-token-loss: the gradients hold the loss sums (averaged over dp by the
            # reduction); divide by the global batch's number of loss tokens.
            loss_sum, global_tokens = self._dp_sum(torch.stack([total, tokens])).unbind()
            global_tokens = global_tokens.clamp(min=1.0)
            scale_grads_(params, self.dims.replicas / global_tokens)
            per_token_mean = loss_sum / global_tokens
        found_inf: torch.Tensor | None = None
        if self.scaler is not None:
            found_inf = unscale_grads_(params, 1.0 / scale)
        elif a.clip_grad <= 0:
            found_inf = found_inf_in_grads(params)
        clip = self.pipeline.clip_grad_norm_ if self.pipeline is not None else clip_grad_norm_  # norm over stages
        grad_norm_t = clip(params, a.clip_grad) if a.clip_grad > 0 else None
        if found_inf is None:  # the norm is non-finite exactly when a gradient is: no second pass over them
            assert grad_norm_t is not None
            found_inf = (~torch.isfinite(grad_norm_t)).float()
        if self.world_size > 1:
            reduce_found_inf(found_inf)  # MAX over all ranks: every rank skips the same steps
        if per_token_mean is not None:
            mean_loss = per_token_mean
        else:
            mean_loss = self._dp_mean(self._cp_sum(total) / self.num_micro_batches)
        # With fused optimizer kernels the step is queued here and skips itself on the device when
        # found_inf is set (torch's fused Adam/SGD take it, as under GradScaler), so the device runs
        # the update while the host goes on; otherwise the host reads the flags and decides.
        norm_value = grad_norm_t.detach().float().reshape(()) if grad_norm_t is not None else found_inf.new_zeros(())
        flags = torch.stack([found_inf.float().reshape(()), torch.isfinite(mean_loss).float(),
                             norm_value.to(found_inf.device), mean_loss.detach().float().reshape(())])
        device_skip = bool(self.optimizer.defaults.get("fused"))  # fused kernels on the CPU too
        ready = None
        if device_skip and flags.is_cuda:  # the flags' copy is queued ahead of the step
            flags = flags.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        self.settle()  # the previous iteration's schedule step comes before this optimizer step
        self._stop_on_nan_iterations()
        if device_skip:
            self._queue_step_skipping_on_device(found_inf)
        self._pending = _PendingStep(self.state.iteration + 1, flags, ready, grad_norm_t is not None,
                                     not device_skip, self.current_global_batch_size)
        if not device_skip or self.scaler is not None:  # the host decides the step (or the next loss scale)
            self.settle()

    def settle(self) -> StepResult | None:
        """Finish the pending iteration, if any: read its flags (waiting for them), advance the loss
        scale and the LR schedule (the optimizer step too where the host decides it), count it in
        the interval's statistics; its result, or None when nothing was pending."""
        p, self._pending = self._pending, None
        if p is None:
            return None
        if p.ready is not None:
            waited = time.perf_counter()
            p.ready.synchronize()
            self.flags_wait_s += time.perf_counter() - waited
        found, loss_finite, norm, loss_value = p.flags.tolist()
        bad, loss_nan = found > 0, not loss_finite
        if self.scaler is not None:
            self.scaler.update(bad)
        if not bad:
            if p.host_steps:
                self.optimizer.step()
            self.scheduler.step(p.global_batch_size)
        result = StepResult(loss_value, norm if p.has_norm and not bad else None, bad,
                            loss_nan or (bad and self.scaler is None))
        self._count(p.iteration, result)
        return result

    def _count(self, iteration: int, result: StepResult) -> None:
        """Add a settled iteration to the run's counters and the log interval's statistics."""
        self.interval.add(result)
        if result.skipped and self.scaler is not None:
            self.state.skipped_iterations += 1
        if result.nan:
            self.state.nan_iterations += 1
        self.last_result = (iteration, result)

    def _stop_on_nan_iterations(self) -> None:
        if self.state.nan_iterations >= self.args.max_nan_iterations:
            raise SystemExit(f"error: stopping: {self.state.nan_iterations} iterations had a NaN/inf loss or "
                             f"gradient (--max-nan-iterations {self.args.max_nan_iterations}); lower --lr, use "
                             f"--bf16 or check the data")

    def _queue_step_skipping_on_device(self, found_inf: torch.Tensor) -> None:
        """Queue the optimizer step with ``found_inf``: torch's fused kernels then leave weights,
        states and step counts alone when it is set (what GradScaler relies on)."""
        self.optimizer.found_inf = found_inf.float().reshape(())  # type: ignore[attr-defined]
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf  # type: ignore[attr-defined]

    def _dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a per-rank value over the data x context parallel ranks (every token of the global batch)."""
        return _summed(value, self.dims.replicas, self.dims.replica_mesh)

    def _cp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a per-rank value over the context-parallel ranks (the parts of each sequence)."""
        return _summed(value, self.cp_size, lambda: self.dims.submesh("cp"))

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a per-rank loss over the data-parallel ranks (the global batch's mean)."""
        return _summed(value, self.dp_size, lambda: self.dims.submesh("dp")) / self.dp_size

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, data_iter: Iterator[torch.Tensor] | None, eval_iters: int) -> float | None:
        if data_iter is None or eval_iters <= 0:
            return None
        a = self.args
        if self.num_micro_batches != a.num_micro_batches:  # evaluation uses the full global batch
            training_micro_batches, self.num_micro_batches = self.num_micro_batches, a.num_micro_batches
            try:
                return self.evaluate(data_iter, eval_iters)
            finally:
                self.num_micro_batches = training_micro_batches
                if self.pipeline is not None:
                    self.pipeline.set_num_micro_batches(training_micro_batches)
        if self.pipeline is not None:
            self.pipeline.set_num_micro_batches(a.num_micro_batches)
        self.model.eval()
        self._grad_fusion()
        total = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device)
        for _ in range(eval_iters):
            if self.pipeline is not None:
                total += self.pipeline.eval_step(self._micro_batches(data_iter),
                                                 autocast=self.precision.autocast(self.device))
                if self.per_token_loss:
                    tokens += self.pipeline.token_count_on_all_ranks()
            elif self.per_token_loss:
                for _ in range(a.num_micro_batches):
                    loss_sum, n = self._forward_loss_sum(next(data_iter))
                    total += loss_sum
                    tokens += n
            else:
                for _ in range(a.num_micro_batches):
                    total += self._forward_loss(next(data_iter))
            self.state.consumed_valid_samples += a.global_batch_size
        self.model.train()
        if self.per_token_loss:
            loss_sum, n = self._dp_sum(torch.stack([total, tokens])).unbind()
            return float(loss_sum / n.clamp(min=1.0))
        return float(self._dp_mean(self._cp_sum(total) / (eval_iters * a.num_micro_batches)))

    def evaluate_and_print(self, prefix: str, data_iter: Any, iteration: int) -> float | None:
        with self.housekeeping.around_evaluation():
            loss = self.evaluate(data_iter, self.args.eval_iters)
        if loss is None:
            return None
        print_rank_last(format_validation_block(format_validation_line(iteration, loss, prefix=prefix)))
        self.writer.log_validation(iteration, loss, consumed_samples=self.state.consumed_train_samples,
                                   log_ppl=True)
        return loss

    # ------------------------------------------------------------------ the loop
    def _memory_estimate(self) -> MemoryEstimate:
        a = self.args
        return estimate_memory(
            self.model_config, seq_length=a.seq_length, micro_batch_size=a.micro_batch_size, tp=self.dims.tp,
            pp=self.dims.pp, dp=self.dims.dp, zero_stage=a.zero_stage, sequence_parallel=a.sequence_parallel,
            recompute_granularity=a.recompute_granularity, half_precision=self.precision.dtype != torch.float32,
            optimizer=a.optimizer, loss_chunked=bool(getattr(a, "cross_entropy_chunk_size", 0)),
            num_micro_batches=a.num_micro_batches, cp=self.dims.cp)

    def train(self) -> TrainState:
        a = self.args
        train_iters = a.train_iters_derived
        exits = ExitRequest(a, self.start_time, self.device)
        print_rank0(f" training: {self.module.num_parameters():,} parameters, {train_iters} iterations, "
                    f"global batch {a.global_batch_size} = micro-batch {a.micro_batch_size} x "
                    f"{a.num_micro_batches} micro-batches x {self.dp_size} data-parallel, {self.precision.name} "
                    f"on {self.device}" + (f"; {self.dims.describe()}" if self.world_size > 1 else ""))
        if self.rampup is not None:
            r = self.rampup
            print_rank0(f" batch size ramp-up: global batch {r.start} growing by {r.increment} over the first "
                        f"{r.samples:,} samples to {a.global_batch_size} ({train_iters} iterations for "
                        f"{a.train_samples:,} samples)")
        estimate = self._memory_estimate()
        print_rank0(f" {estimate.line()}")
        fusion = getattr(self.module, "grad_accumulation_fusion", None)
        if fusion is not None:
            print_rank0(f" gradient-accumulation fusion: {len(fusion.slots)} weights compute from {self.precision.name} "
                        "copies refreshed once per step and add their gradients into the fp32 .grad inside the "
                        "weight-gradient matmul (--no-gradient-accumulation-fusion turns it off)")
        fp8 = [m.fp8_report for m in self.module.modules() if hasattr(m, "fp8_report")]
        if fp8:
            kept = [name for _, left in fp8 for name in left]
            print_rank0(f" fp8 ({a.fp8_format}: e4m3 forward, {'e5m2' if a.fp8_format == 'hybrid' else 'e4m3'} "
                        f"gradients; dynamic per-tensor scales; torchao): {sum(len(c) for c, _ in fp8)} linear "
                        "layers of the transformer layers run fp8 matmuls"
                        + (" (on this rank's pipeline stages)" if self.dims.pp > 1 else "")
                        + "; the output layer stays bf16"
                        + (f"; kept in bf16 (sizes not multiples of 16): {', '.join(kept)}" if kept else ""))
        self.interval = _IntervalStats()
        t_last = time.time()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.housekeeping.start()
        while self.state.iteration < train_iters:
            self.housekeeping.before_iteration(self.state.iteration)
            if self.rampup is not None:
                self.num_micro_batches = self.rampup.micro_batches_at(self.state.consumed_train_samples)
                if self.pipeline is not None:
                    self.pipeline.set_num_micro_batches(self.num_micro_batches)
            self.queue_step()  # settles the previous iteration; this one may stay pending
            self.state.iteration += 1
            self.housekeeping.after_optimizer_step(self.state.iteration)
            self.state.consumed_train_samples += self.current_global_batch_size
            it = self.state.iteration
            tensorboard = self.writer.active and it % a.tensorboard_log_interval == 0
            log = it % a.log_interval == 0
            evaluate = bool(a.eval_interval and it % a.eval_interval == 0 and self.valid_iter is not None)
            save = bool(a.save and a.save_interval and it % a.save_interval == 0)
            if tensorboard or log or evaluate or save or it == train_iters:
                self.settle()  # what follows reads this iteration's result or the schedule after it
            if tensorboard:
                assert self.last_result is not None and self.last_result[0] == it
                result = self.last_result[1]
                self.writer.log_train(it, consumed_samples=self.state.consumed_train_samples,
                                      losses={"lm loss": result.loss}, learning_rate=self.scheduler.current_lr(),
                                      batch_size=self.current_global_batch_size, grad_norm=result.grad_norm,
                                      loss_scale=float(self.scaler.scale) if self.scaler is not None else None)
            if log:
                # The host waited for this iteration's flags just above, so the time between two log
                # lines is the iterations' time (the last optimizer step, still running on the GPU,
                # is counted in the next interval).
                now = time.time()
                self._log(self.interval, (now - t_last) / self.interval.iterations, train_iters)
                if self.device.type == "cuda" and self.state.iteration == a.log_interval:
                    peak = torch.cuda.max_memory_allocated(self.device) / 2**30
                    print(f" [rank {get_rank()}] measured peak memory after {self.state.iteration} iterations: "
                          f"{peak:.2f} GiB (theoretical {estimate.total / 2**30:.2f} GiB)", flush=True)
                self.interval = _IntervalStats()
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
                print_rank_last(f" {reason}")
                if a.save and not save:
                    self.save()
                self.close()
                sys.exit(0)
        return self.state

    @property
    def current_global_batch_size(self) -> int:
        """The global batch of the current iteration (below --global-batch-size during a ramp-up)."""
        return self.num_micro_batches * self.args.micro_batch_size * self.dp_size

    def _log(self, stats: "_IntervalStats", seconds_per_iter: float, train_iters: int) -> None:
        a = self.args
        batch = self.current_global_batch_size
        tflops = self.flops_per_iteration * batch / a.global_batch_size / (seconds_per_iter * 1e12 * self.world_size)
        tokens_per_gpu = batch * a.seq_length / seconds_per_iter / self.world_size
        mem_gib = (torch.cuda.max_memory_allocated(self.device) / 2**30) if self.device.type == "cuda" else None
        mfu = tflops / self.peak_tflops if self.peak_tflops else None
        line = format_train_log_line(
            iteration=self.state.iteration, train_iters=train_iters,
            consumed_samples=self.state.consumed_train_samples, elapsed_ms=seconds_per_iter * 1000.0,
            throughput_tflops=tflops, learning_rate=self.scheduler.current_lr(),
            global_batch_size=batch, losses={"lm loss": stats.mean_loss()},
            loss_scale=float(self.scaler.scale) if self.scaler is not None else 1.0,
            grad_norm=stats.last_grad_norm, skipped_iterations=stats.skipped, nan_iterations=stats.nan,
            tokens_per_sec_per_gpu=tokens_per_gpu,
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
            self.writer.close()
        finally:
            if self._save_lock is not None:
                self._save_lock.release()


def _summed(value: torch.Tensor, size: int, mesh: Any) -> torch.Tensor:
    """``value`` summed over the ``size`` ranks of ``mesh()`` (a new tensor; the value itself when alone)."""
    if size == 1:
        return value
    value = value.clone()
    torch.distributed.all_reduce(value, group=mesh().get_group())
    return value


class _IntervalStats:
    """Sums over the iterations between two log lines (losses stay on device until logged)."""

    def __init__(self) -> None:
        self.iterations = 0
        self.loss_sum = 0.0
        self.counted = 0
        self.skipped = 0
        self.nan = 0
        self.last_grad_norm: float | None = None

    def add(self, r: StepResult) -> None:
        self.iterations += 1
        if r.skipped:
            self.skipped += int(not r.nan)
        if r.nan:
            self.nan += 1
        if not r.skipped and not r.nan:
            self.loss_sum += r.loss
            self.counted += 1
        if r.grad_norm is not None:
            self.last_grad_norm = r.grad_norm

    def mean_loss(self) -> float:
        return self.loss_sum / self.counted if self.counted else float("nan")


def pretrain(args: argparse.Namespace, trainer_class: type[Trainer] = Trainer) -> TrainState:
    """Build everything from parsed arguments, train, evaluate at the end, save."""
    for note in getattr(args, "legacy_notes", []):
        print_rank0(note)
    trainer = trainer_class(args)
    try:
        if not args.skip_train:
            trainer.train()
        it = trainer.state.iteration
        if args.save and (not args.save_interval or it % args.save_interval != 0) and not args.skip_train:
            trainer.save()
        if trainer.valid_ds is not None and args.eval_iters > 0:
            trainer.evaluate_and_print(f"iteration {it} on validation set", trainer.valid_iter, it)
        if trainer.test_ds is not None and args.eval_iters > 0:
            test_iter = iter(build_pretraining_data_loader(trainer.test_ds, 0, args.micro_batch_size,
                                                           trainer.dp_rank, trainer.dp_size, 0))
            trainer.evaluate_and_print(f"iteration {it} on test set", test_iter, it)
    finally:
        trainer.close()
        state = trainer.state
        del trainer  # the model and its process groups must be unreachable before they are destroyed
        destroy_distributed()
    return state
