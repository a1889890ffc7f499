"""One training iteration: micro-batches through the objective, backward, gradient clipping, the
optimizer step (queued on the device where it can skip itself), and settling its result later.

:class:`StepMixin` is the part of :class:`megatrain.training.trainer.Trainer` that runs an
iteration. Every loss the objective names is carried as a vector (one entry per name): a
micro-batch back-propagates the sum of its losses' means, the log line prints each one.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from megatrain.data.batch import to_device
from megatrain.models.common.moe.aux_loss import set_aux_loss_scale
from megatrain.models.common.objective import loss_means
from megatrain.parallel.context_parallel import split_batch
from megatrain.parallel.data_parallel import gradient_sync
from megatrain.training.loss_scaler import found_inf_in_grads, reduce_found_inf, unscale_grads_
from megatrain.optimizer import (clip_divisor, clip_grad_norm_, count_zeros, folds_grad_divisor, get_total_norm,
                                 scale_grads_)

__all__ = ["StepMixin", "StepResult", "IntervalStats", "summed"]


@dataclass
class StepResult:
    loss: float  # mean loss of the global batch (the sum over the objective's losses)
    grad_norm: float | None
    skipped: bool
    nan: bool
    losses: dict[str, float] = field(default_factory=dict)  # each loss the objective names
    num_zeros: int | None = None  # zeros among the gradients (--log-num-zeros-in-grad)
    params_norm: float | None = None  # L2 norm of the trained weights after the step (--log-params-norm)


@dataclass
class _PendingStep:
    """An iteration queued on the device whose flags the host has not read yet."""
    iteration: int  # 1-based
    flags: torch.Tensor  # (overflow, loss finite, norm, losses...); on the host, or arriving there when ready is set
    ready: Any  # torch.cuda.Event recorded after the flags' copy, or None
    has_norm: bool
    host_steps: bool  # the optimizer step waits for the host's decision (not queued yet)
    global_batch_size: int


def _has_fsdp_modules(module: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def summed(value: torch.Tensor, size: int, mesh: Any) -> torch.Tensor:
    """``value`` summed over the ``size`` ranks of ``mesh()`` (a new tensor; the value itself when alone)."""
    if size == 1:
        return value
    value = value.clone()
    torch.distributed.all_reduce(value, group=mesh().get_group())
    return value


class IntervalStats:
    """Sums over the iterations between two log lines (losses stay on device until logged)."""

    def __init__(self) -> None:
        self.iterations = 0
        self.loss_sums: dict[str, float] = {}
        self.counted = 0
        self.skipped = 0
        self.nan = 0
        self.last_grad_norm: float | None = None
        self.last_num_zeros: int | None = None
        self.last_params_norm: float | None = None

    def add(self, r: StepResult) -> None:
        self.iterations += 1
        if r.skipped:
            self.skipped += int(not r.nan)
        if r.nan:
            self.nan += 1
        if not r.skipped and not r.nan:
            for name, value in r.losses.items():
                self.loss_sums[name] = self.loss_sums.get(name, 0.0) + value
            self.counted += 1
        if r.grad_norm is not None:
            self.last_grad_norm = r.grad_norm
        if r.num_zeros is not None:
            self.last_num_zeros = r.num_zeros
        if r.params_norm is not None:
            self.last_params_norm = r.params_norm

    def mean_losses(self, names: tuple[str, ...]) -> dict[str, float]:
        return {name: self.loss_sums.get(name, 0.0) / self.counted if self.counted else float("nan")
                for name in names}


class StepMixin:
    """Forward/backward of an iteration's micro-batches and the optimizer step (see the module doc)."""

    # ---- one micro-batch ------------------------------------------------------------------------
    def _rank_batch(self, samples: Any) -> Any:
        """The objective's micro-batch on the device; with context parallelism, this rank's part."""
        b = self.objective.make_batch(to_device(self.objective.host_batch(samples), self.device))
        return split_batch(b, self.cp_size, self.cp_rank) if self.cp_size > 1 else b

    def _batch_losses(self, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss sums, their loss-token counts) of a micro-batch on the device, one entry per
        loss the objective names, over this rank's tokens (with context parallelism, its part of
        each sequence)."""
        with self.precision.autocast(self.device):
            output = self.objective.forward(self.model, b)
        terms = self.objective.losses(output, self.objective.loss_target(b))
        return torch.stack([s for s, _ in terms]), torch.stack([n for _, n in terms])

    def _mean_losses(self, loss_sums: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Each loss's mean over its loss tokens (with context parallelism, this rank's share of it:
        its tokens' loss over the whole sequence's token count; the shares sum to it)."""
        return loss_means(loss_sums, self._cp_sum(tokens.detach()))

    def _micro_batch_loss(self, loss_sums: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """What a training micro-batch back-propagates (times :meth:`_micro_batch_weight`) and
        records, per loss: the loss sums with --calculate-per-token-loss (divided by the global
        token count after the backward), else the means."""
        return loss_sums if self.per_token_loss else self._mean_losses(loss_sums, tokens)

    def _micro_batch_weight(self, scale: float) -> float:
        """The factor on a micro-batch's loss in its backward: the loss scale and, for mean losses,
        1 / micro-batches (x cp: the gradient reduction averages over data x context parallel ranks)."""
        return scale if self.per_token_loss else scale * self.cp_size / self.num_micro_batches

    def _micro_batch_backward(self, batch: Any, weight: float, fusion: Any, hold_others: bool,
                              prefetch: Any = None, fresh: bool = False) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Forward and backward of one training micro-batch, its gradients added to those so far:
        (its losses, their loss-token counts, ``prefetch()``'s result, called before the backward so
        that the next micro-batch's inputs are queued first)."""
        if fusion is not None:  # the gradients so far become the matmuls' addends
            fusion.stage(hold_others=hold_others, fresh=fresh)
        loss_sums, n = self._batch_losses(batch)
        if fusion is not None:
            fusion.release()
        fetched = prefetch() if prefetch is not None else None
        losses = self._micro_batch_loss(loss_sums, n)
        (losses.sum() * weight).backward()
        if fusion is not None:
            fusion.merge_held()
        return losses.detach(), n.detach(), fetched

    def _graphed_micro_batch(self, samples: Any, weight: float, totals: torch.Tensor) -> None:
        """One micro-batch as its CUDA graph records it: batch, forward, backward, the losses and
        the loss-token counts added into ``totals`` (see :mod:`megatrain.runtime.cuda_graph`)."""
        losses, n, _ = self._micro_batch_backward(self.objective.make_batch(samples), weight, self.grad_fusion,
                                                  hold_others=True)
        totals += torch.stack([losses, n])

    def _micro_batches(self, data_iter: Iterator[Any]) -> list[Any]:
        """One iteration's micro-batches as model inputs (pipeline parallel runs them all at once)."""
        return [self._rank_batch(next(data_iter)) for _ in range(self.num_micro_batches)]

    def _grad_fusion(self) -> Any:
        """The gradient-accumulation fusion with its half-precision weights refreshed, or None."""
        if self.grad_fusion is not None:
            self.grad_fusion.refresh()
        return self.grad_fusion

    def _loss_zeros(self) -> torch.Tensor:
        return torch.zeros(len(self.objective.loss_names), device=self.device)

    def _micro_batches_backward(self, fusion: Any, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of the iteration's micro-batches, the gradients summed over them
        (reduced over data-parallel ranks after the last); (sums of their losses, their loss-token
        counts with --calculate-per-token-loss, else zeros)."""
        assert self.train_iter is not None
        total = self._loss_zeros()
        tokens = self._loss_zeros()
        weight = self._micro_batch_weight(scale)
        train_iter = self.train_iter
        batch = self._rank_batch(next(train_iter))
        # One micro-batch (and no CUDA graphs, whose recorded micro-batch adds into fixed buffers):
        # the weight-gradient matmuls write the step's gradients instead of adding into zeros.
        fresh = self.num_micro_batches == 1 and self.cuda_graphs is None
        for i in range(self.num_micro_batches):
            last = i == self.num_micro_batches - 1
            # Data-parallel gradient reduction only after the last micro-batch, which therefore
            # cannot hold gradients aside (the reduction reads those autograd accumulates).
            with gradient_sync(self.model, last, self.parallelized.keep_unsharded):
                losses, n, batch = self._micro_batch_backward(
                    batch, weight, fusion, hold_others=not (last and self.dims.replicas > 1),
                    prefetch=None if last else lambda: self._rank_batch(next(train_iter)), fresh=fresh)
            total += losses
            if self.per_token_loss:  # only the per-token loss reads the count
                tokens += n
        if self.fp8_scaling is not None:
            self.fp8_scaling.after_backward()
        return total, tokens

    # ---- one iteration --------------------------------------------------------------------------
    def _train_mode(self) -> None:
        """Put the model in training mode: the whole module tree on the first iteration, then again
        only when the root has left it (evaluation and generation switch the whole model back).
        ``Module.train()`` walks every submodule, a per-iteration cost of ~1-2 us per module."""
        if not self.model.training or not getattr(self, "_train_mode_set", False):
            self.model.train()
            self._train_mode_set = True

    def _module_parameters(self) -> list[torch.Tensor] | Iterator[torch.Tensor]:
        """The module's parameters in their order. Read once and kept, unless the model has FSDP2
        modules (they swap each parameter between its sharded and gathered tensor, so the list
        must be read when asked); ``Module.parameters()`` walks every submodule each time."""
        cached = getattr(self, "_parameters_cache", None)
        if cached is None:  # first call: keep the list, or False where it must be read each time
            cached = False if _has_fsdp_modules(self.module) else list(self.module.parameters())
            self._parameters_cache = cached
        return cached if cached is not False else self.module.parameters()

    def train_step(self) -> StepResult:
        """One iteration, finished: its result, with the LR schedule (and loss scale) advanced."""
        self.queue_step()
        self.settle()
        assert self.last_result is not None and self._pending is None
        return self.last_result[1]

    def queue_step(self) -> None:
        """Queue one iteration: forward and backward of its micro-batches, gradient clipping and,
        where the device can skip it by itself, the optimizer step; the iteration's flags (overflow,
        loss finite, norm, losses) travel to the host behind it.

        Where the step does not need the host's decision (fused optimizer kernels on CUDA, no loss
        scaling), the iteration is left *pending*: the host reads its flags only when the next
        iteration's optimizer step is about to be queued (the LR schedule must have advanced by
        then) or when the training loop needs the result (log line, checkpoint, evaluation), so that
        the host prepares the next iteration while the device still runs this one. Otherwise it is
        settled here."""
        a = self.args
        assert self.train_iter is not None
        self._train_mode()
        graphs = self.cuda_graphs
        if graphs is not None:
            graphs.begin_iteration(lambda: self.optimizer.zero_grad(set_to_none=True))
        else:
            self.optimizer.zero_grad(set_to_none=True)
        fusion = self._grad_fusion()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        moe = getattr(self, "moe_metrics", None)
        mtp = getattr(self, "mtp_metrics", None)
        if moe is not None or mtp is not None:  # the balancing losses' and the prediction depths' gradients get
            set_aux_loss_scale(self._micro_batch_weight(scale))  # the main loss's factor (constant in an iteration)
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
        if moe is not None:  # expert biases, global_aux_loss counts, logged values: before the step
            moe.after_backward(self.num_micro_batches)
        if mtp is not None:
            mtp.after_backward(self.num_micro_batches)
        self.housekeeping.after_forward_backward()
        params = [p for p in self._module_parameters() if p.grad is not None]
        per_token_mean = None
        if self.per_token_loss:
            total, tokens = total.reshape(()), tokens.reshape(())  # one loss (the trainer checks)
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
        if found_inf is not None and not params:  # nothing trained here (a frozen pipeline stage): 0 on the
            found_inf = found_inf.to(self.device)  # run's device, for the reduction over all ranks
        clip = self.pipeline.clip_grad_norm_ if self.pipeline is not None else clip_grad_norm_  # norm over stages
        device_skip = bool(self.optimizer.defaults.get("fused"))  # fused kernels on the CPU too
        # A fused step divides the gradients by a device scalar as it reads them (what GradScaler hands
        # it): the clipping then costs no pass of its own over the gradients.
        fold_clip = a.clip_grad > 0 and device_skip and self.scaler is None and folds_grad_divisor(self.optimizer, params)
        grad_norm_t = clip(params, 0.0 if fold_clip else a.clip_grad) if a.clip_grad > 0 else None
        grad_divisor = clip_divisor(a.clip_grad, grad_norm_t) if fold_clip else None
        if found_inf is None:  # the norm is non-finite exactly when a gradient is: no second pass over them
            assert grad_norm_t is not None
            found_inf = (~torch.isfinite(grad_norm_t)).float()
        if self.world_size > 1:
            reduce_found_inf(found_inf)  # MAX over all ranks: every rank skips the same steps
        if per_token_mean is not None:
            mean_losses = per_token_mean
        else:
            mean_losses = self._dp_mean(self._cp_sum(total) / self.num_micro_batches)
        mean_loss = mean_losses.sum() if mean_losses.numel() > 1 else mean_losses.reshape(())
        # With fused optimizer kernels the step is queued here and skips itself on the device when
        # found_inf is set (torch's fused Adam/SGD take it, as under GradScaler), so the device runs
        # the update while the host goes on; otherwise the host reads the flags and decides.
        norm_value = grad_norm_t.detach().float().reshape(()) if grad_norm_t is not None else found_inf.new_zeros(())
        zeros = self._count_zeros(params) if getattr(a, "log_num_zeros_in_grad", False) else found_inf.new_zeros(())
        # float64: the zero count is exact far beyond float32's 2^24
        flags = torch.cat([torch.stack([found_inf.double().reshape(()), torch.isfinite(mean_loss).double(),
                                        norm_value.double().to(found_inf.device),
                                        zeros.double().reshape(()).to(found_inf.device)]),
                           mean_losses.detach().double().reshape(-1).to(found_inf.device)])
        ready = None
        if device_skip and flags.is_cuda:  # the flags' copy is queued ahead of the step
            flags = flags.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        self.settle()  # the previous iteration's schedule step comes before this optimizer step
        self._stop_on_nan_iterations()
        if device_skip:
            self._queue_step_skipping_on_device(found_inf, grad_divisor)
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
        found, loss_finite, norm, zeros, *loss_values = p.flags.tolist()
        bad, loss_nan = found > 0, not loss_finite
        if self.scaler is not None:
            self.scaler.update(bad)
        if not bad:
            if p.host_steps:
                self.optimizer.step()
            self.scheduler.step(p.global_batch_size)
        names = self.objective.loss_names if not self.per_token_loss else self.objective.loss_names[:1]
        # the weights after this iteration's step: the next iteration's step is not queued yet
        params_norm = float(self._params_norm()) if getattr(self.args, "log_params_norm", False) else None
        result = StepResult(sum(loss_values) if len(loss_values) > 1 else loss_values[0],
                            norm if p.has_norm and not bad else None, bad,
                            loss_nan or (bad and self.scaler is None), dict(zip(names, loss_values)),
                            num_zeros=int(zeros) if getattr(self.args, "log_num_zeros_in_grad", False) else None,
                            params_norm=params_norm)
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
        if not getattr(self.args, "check_for_nan_in_loss_and_grad", True):
            return  # --no-check-for-nan-in-loss-and-grad: such iterations are skipped, the run goes on
        if self.state.nan_iterations >= self.args.max_nan_iterations:
            raise SystemExit(f"error: stopping: {self.state.nan_iterations} iterations had a NaN/inf loss or "
                             f"gradient (--max-nan-iterations {self.args.max_nan_iterations}); lower --lr, use "
                             f"--bf16 or check the data")

    def _count_zeros(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Zeros among the gradients of ``params`` over the whole model (pipeline stages summed)."""
        return self.pipeline.count_zeros(params) if self.pipeline is not None else count_zeros(params)

    def _params_norm(self) -> torch.Tensor:
        """The L2 norm of the trained weights over the whole model (Megatron's ``--log-params-norm``: the
        parameters that take gradients; pipeline stages combined, each shared weight once)."""
        params = [p for p in self._module_parameters() if p.requires_grad]
        return self.pipeline.params_norm(params) if self.pipeline is not None else get_total_norm(params)

    def _queue_step_skipping_on_device(self, found_inf: torch.Tensor, grad_divisor: torch.Tensor | None) -> None:
        """Queue the optimizer step with ``found_inf``: torch's fused kernels then leave weights,
        states and step counts alone when it is set (what GradScaler relies on); with ``grad_divisor``
        they divide every gradient by it first (and store the divided gradient, as after clipping)."""
        self.optimizer.found_inf = found_inf.float().reshape(())  # type: ignore[attr-defined]
        if grad_divisor is not None:
            self.optimizer.grad_scale = grad_divisor  # type: ignore[attr-defined]
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf  # type: ignore[attr-defined]
            if grad_divisor is not None:
                del self.optimizer.grad_scale  # type: ignore[attr-defined]

    # ---- sums over ranks ------------------------------------------------------------------------
    def _dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a per-rank value over the data x context parallel ranks (every token of the global batch)."""
        return summed(value, self.dims.replicas, self.dims.replica_mesh)

    def _cp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a per-rank value over the context-parallel ranks (the parts of each sequence)."""
        return summed(value, self.cp_size, lambda: self.dims.submesh("cp"))

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a per-rank loss over the data-parallel ranks (the global batch's mean)."""
        return summed(value, self.dp_size, lambda: self.dims.submesh("dp")) / self.dp_size
