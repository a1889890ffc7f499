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

    def __init__(self, binary_head: bool = True) -> None:
        self.binary_head = binary_head
        self.loss_names = ("lm loss", "sop loss") if binary_head else ("lm loss",)

    def make_batch(self, samples: dict[str, torch.Tensor]) -> MaskedLMBatch:
        loss_mask = samples["loss_mask"].float()
        labels = samples["labels"].long().masked_fill(loss_mask == 0, IGNORE_INDEX)
        return MaskedLMBatch(
            tokens=samples["text"].long(), tokentype_ids=samples["types"].long(), labels=labels,
            loss_mask=loss_mask, padding_mask=samples["padding_mask"] != 0,
            sentence_order=samples["is_random"].long().view(-1) if self.binary_head else None)

    def forward(self, model: Any, batch: MaskedLMBatch) -> torch.Tensor:
        # Megatron's pretrain_bert.py: without the binary head there are no token types.
        return model(batch.tokens, padding_mask=batch.padding_mask,
                     tokentype_ids=batch.tokentype_ids if self.binary_head else None,
                     labels=batch.labels, sentence_order=batch.sentence_order)

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
                      "sentence_order": batch.sentence_order if last else None}
