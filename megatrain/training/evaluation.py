"""Validation and test evaluation inside a training run: the objective's losses over ``--eval-iters``
global batches, printed as Megatron's validation block and written to TensorBoard/wandb.

:class:`EvaluationMixin` is the part of :class:`megatrain.training.trainer.Trainer` that evaluates.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from megatrain.training.console import print_rank_last
from megatrain.training.logging import format_validation_block, format_validation_line

__all__ = ["EvaluationMixin"]


class EvaluationMixin:
    @torch.no_grad()
    def evaluate(self, data_iter: Iterator[Any] | None, eval_iters: int) -> dict[str, float] | None:
        """Every loss the objective names, averaged over ``eval_iters`` global batches (None
        without data or iterations)."""
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
        total = self._loss_zeros()
        tokens = self._loss_zeros()
        for _ in range(eval_iters):
            if self.pipeline is not None:
                total += self.pipeline.eval_step(self._micro_batches(data_iter),
                                                 autocast=self.precision.autocast(self.device))
                if self.per_token_loss:
                    tokens += self.pipeline.token_count_on_all_ranks()
            elif self.per_token_loss:
                for _ in range(a.num_micro_batches):
                    loss_sums, n = self._batch_losses(self._rank_batch(next(data_iter)))
                    total += loss_sums
                    tokens += n
            else:
                for _ in range(a.num_micro_batches):
                    total += self._mean_losses(*self._batch_losses(self._rank_batch(next(data_iter))))
            self.state.consumed_valid_samples += a.global_batch_size
        self.model.train()
        if self.per_token_loss:
            loss_sums, n = self._dp_sum(torch.stack([total, tokens])).unbind()
            values = loss_sums / n.clamp(min=1.0)
        else:
            values = self._dp_mean(self._cp_sum(total) / (eval_iters * a.num_micro_batches))
        return dict(zip(self.objective.loss_names, values.tolist()))

    def evaluate_and_print(self, prefix: str, data_iter: Any, iteration: int) -> dict[str, float] | None:
        with self.housekeeping.around_evaluation():
            losses = self.evaluate(data_iter, self.args.eval_iters)
        if losses is None:
            return None
        print_rank_last(format_validation_block(format_validation_line(iteration, losses, prefix=prefix)))
        self.writer.log_validation(iteration, losses, consumed_samples=self.state.consumed_train_samples,
                                   log_ppl=True)
        return losses
