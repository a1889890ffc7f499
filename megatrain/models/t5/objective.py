"""The T5 family's objective: Megatron's ``lm loss``, the mean cross entropy of the decoder's
predictions over the loss-mask tokens (``pretrain_t5.py`` uses ``pretrain_gpt.py``'s loss function),
from samples with Megatron's T5 field names."""

from __future__ import annotations

from typing import Any

import torch

from megatrain.data.batch import Seq2SeqBatch
from megatrain.models.common.objective import Objective

__all__ = ["Seq2SeqObjective", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # a label the cross entropy skips (the data's -1 where nothing is predicted)


class Seq2SeqObjective(Objective):
    """Batches from the T5 dataset's samples: dicts of ``text_enc`` [s_enc] (the corrupted input with
    sentinels), ``text_dec`` [s_dec] (the decoder input: bos, then each sentinel and its span),
    ``labels`` [s_dec] (the decoder input shifted by one, ending in eos; -1 where nothing is predicted),
    ``loss_mask`` [s_dec], ``enc_mask`` / ``dec_mask`` (1 for a real token, 0 for padding) and
    ``truncated``; the model returns the per-token loss given the labels
    (:class:`megatrain.models.t5.model.T5Model`)."""

    loss_names = ("lm loss",)

    def make_batch(self, samples: dict[str, torch.Tensor]) -> Seq2SeqBatch:
        loss_mask = samples["loss_mask"].float()
        labels = samples["labels"].long().masked_fill(loss_mask == 0, IGNORE_INDEX)
        return Seq2SeqBatch(encoder_tokens=samples["text_enc"].long(), encoder_padding_mask=samples["enc_mask"] != 0,
                            decoder_tokens=samples["text_dec"].long(), labels=labels, loss_mask=loss_mask,
                            decoder_padding_mask=samples["dec_mask"] != 0)

    def forward(self, model: Any, batch: Seq2SeqBatch) -> torch.Tensor:
        return model(batch.encoder_tokens, batch.decoder_tokens, encoder_padding_mask=batch.encoder_padding_mask,
                     decoder_padding_mask=batch.decoder_padding_mask, labels=batch.labels)

    def loss_target(self, batch: Seq2SeqBatch) -> torch.Tensor:
        return batch.loss_mask

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        weights = target.to(output.dtype)
        return [((output * weights).sum(), weights.sum())]

    def stage_inputs(self, batch: Seq2SeqBatch, *, first: bool, last: bool) -> tuple[tuple, dict[str, Any]]:
        raise ValueError("--pipeline-model-parallel-size > 1 is not supported for T5 (as in Megatron-LM)")
