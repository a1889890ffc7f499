"""The GPT family's objective: next-token prediction (Megatron's ``lm loss``), the masked mean of the
per-token cross entropy over the loss mask."""

from __future__ import annotations

from typing import Any

import torch

from megatrain.data.batch import CausalLMBatch, make_batch
from megatrain.models.common.objective import Objective

__all__ = ["CausalLMObjective"]


class CausalLMObjective(Objective):
    """Batches from ``[b, s+1]`` token samples (:func:`megatrain.data.batch.make_batch` with the
    ``--reset-position-ids`` / ``--reset-attention-mask`` / ``--eod-mask-loss`` flags); the model
    returns per-token losses given the labels."""

    loss_names = ("lm loss",)

    def __init__(self, eod: int | None = None, reset_position_ids: bool = False, reset_attention_mask: bool = False,
                 eod_mask_loss: bool = False, mtp_depths: int = 0) -> None:
        self.eod = eod
        self.reset_position_ids, self.reset_attention_mask = reset_position_ids, reset_attention_mask
        self.eod_mask_loss = eod_mask_loss
        self.mtp_depths = mtp_depths  # --mtp-num-layers: the batches carry the shifted targets

    @classmethod
    def from_args(cls, args: Any, tokenizer: Any) -> "CausalLMObjective":
        return cls(tokenizer.eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss,
                   getattr(args, "mtp_num_layers", None) or 0)

    def make_batch(self, samples: torch.Tensor) -> CausalLMBatch:
        return make_batch(samples, self.eod, self.reset_position_ids, self.reset_attention_mask, self.eod_mask_loss,
                          self.mtp_depths)

    def forward(self, model: Any, batch: CausalLMBatch) -> torch.Tensor:
        return model(batch.tokens, position_ids=batch.position_ids, attention_mask=batch.attention_mask,
                     labels=batch.labels, **({"mtp_targets": batch.mtp_targets()} if self.mtp_depths else {}))

    def loss_target(self, batch: CausalLMBatch) -> torch.Tensor:
        return batch.loss_mask

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mask = target.to(output.dtype)
        return [((output * mask).sum(), mask.sum())]

    def stage_inputs(self, batch: CausalLMBatch, *, first: bool, last: bool) -> tuple[tuple, dict[str, Any]]:
        args = (batch.tokens,) if first else ()
        kwargs = {"position_ids": batch.position_ids, "attention_mask": batch.attention_mask,
                  "labels": batch.labels if last else None}
        if last and self.mtp_depths:  # each field a keyword of its own (the schedule splits them)
            kwargs.update(batch.mtp_targets())
        return args, kwargs
