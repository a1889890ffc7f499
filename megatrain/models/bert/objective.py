"""The BERT family's objective: the masked-LM loss (Megatron's ``lm loss``, the mean cross entropy
over the masked positions) and, with the binary head, the sentence-order loss (``sop loss``, the
mean over the samples); the micro-batch's loss is their sum, as in Megatron's ``pretrain_bert.py``."""

from __future__ import annotations

from typing import Any

import torch

from megatrain.data.batch import MaskedLMBatch
from megatrain.models.common.objective import Objective

__all__ = ["MaskedLMObjective", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # a label the cross entropy skips (the data's -1 where nothing is masked)


class MaskedLMObjective(Objective):
    """Batches from the BERT dataset's samples (dicts of Megatron's fields: ``text``, ``types``,
    ``labels``, ``is_random``, ``padding_mask``, ``loss_mask``); the model returns the losses given
    the labels (:class:`megatrain.models.bert.model.BertModel`)."""

    def __init__(self, binary_head: bool = True, max_predictions: int | None = None) -> None:
        """``max_predictions``: the most masked positions a sample can have (the data's bound); when
        given, the masked-LM head runs on that many positions per sample instead of all of them (the
        same losses; a sample with more is an error)."""
        self.binary_head = binary_head
        self.max_predictions = max_predictions
        self.loss_names = ("lm loss", "sop loss") if binary_head else ("lm loss",)

    @classmethod
    def from_args(cls, args: Any) -> "MaskedLMObjective":
        # Megatron's masking makes at most mask_prob x (seq_length - 3) predictions per sample.
        bound = int(args.mask_prob * (args.seq_length - 3)) + 1
        return cls(binary_head=args.bert_binary_head, max_predictions=bound if bound < args.seq_length else None)

    def make_batch(self, samples: dict[str, torch.Tensor]) -> MaskedLMBatch:
        loss_mask = samples["loss_mask"].float()
        labels = samples["labels"].long().masked_fill(loss_mask == 0, IGNORE_INDEX)
        positions = None
        if self.max_predictions is not None:
            unmasked = (loss_mask == 0).to(torch.uint8)
            # No host synchronisation: the check runs on the device, the sort puts masked positions first.
            torch._assert_async((unmasked.shape[1] - unmasked.sum(1) <= self.max_predictions).all(),
                                "a sample has more masked positions than --mask-prob x (--seq-length - 3)")
            positions = torch.argsort(unmasked, dim=1, stable=True)[:, :self.max_predictions]
        return MaskedLMBatch(
            tokens=samples["text"].long(), tokentype_ids=samples["types"].long(), labels=labels,
            loss_mask=loss_mask, padding_mask=samples["padding_mask"] != 0,
            sentence_order=samples["is_random"].long().view(-1) if self.binary_head else None,
            lm_positions=positions)

    def forward(self, model: Any, batch: MaskedLMBatch) -> torch.Tensor:
        # Megatron's pretrain_bert.py: without the binary head there are no token types.
        return model(batch.tokens, padding_mask=batch.padding_mask,
                     tokentype_ids=batch.tokentype_ids if self.binary_head else None,
                     labels=batch.labels, sentence_order=batch.sentence_order, lm_positions=batch.lm_positions)

    def loss_target(self, batch: MaskedLMBatch) -> torch.Tensor:
        """The loss mask [b, s], and with the binary head a last column: 1 where the sample has a
        sentence-order label."""
        if not self.binary_head:
            return batch.loss_mask
        assert batch.sentence_order is not None
        return torch.cat([batch.loss_mask, (batch.sentence_order != -1).to(batch.loss_mask.dtype).unsqueeze(1)], 1)

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        weights = target.to(output.dtype)
        s = output.shape[1] - (1 if self.binary_head else 0)
        terms = [((output[:, :s] * weights[:, :s]).sum(), weights[:, :s].sum())]
        if self.binary_head:
            terms.append(((output[:, s] * weights[:, s]).sum(), weights[:, s].sum()))
        return terms

    def stage_inputs(self, batch: MaskedLMBatch, *, first: bool, last: bool) -> tuple[tuple, dict[str, Any]]:
        args = (batch.tokens,) if first else ()
        return args, {"padding_mask": batch.padding_mask,
                      "tokentype_ids": batch.tokentype_ids if first and self.binary_head else None,
                      "labels": batch.labels if last else None,
                      "sentence_order": batch.sentence_order if last else None,
                      "lm_positions": batch.lm_positions if last else None}
