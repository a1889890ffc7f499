"""One pipeline stage of a BertModel, under the model's own parameter names.

A stage is a BertModel with the layers it does not own deleted and the parts it does not own set to
None. The embedding belongs to the first stage; the final norm, the heads and the losses to the
last. With tied input/output embeddings (the default) the last stage keeps its own copy of
``embedding.word_embeddings.weight`` for the output layer, initialised from the same
``initial_value``; the pipeline sums the two copies' gradients after every backward pass, as
Megatron does (:meth:`BertStage.tied_parameters`), and the copy counts once in the gradient norm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatrain.models.bert.config import BertConfig
from megatrain.models.bert.model import BertModel, padding_attention_mask
from megatrain.models.common.stage import TiedEmbeddingStage

__all__ = ["BertStage"]


class BertStage(TiedEmbeddingStage, BertModel):
    """``forward(x, padding_mask, tokentype_ids, labels, sentence_order)``: ``x`` is token ids on the
    first stage and hidden states [b, s, h] elsewhere; the last stage returns the losses (the logits
    without ``labels``), the others hidden states."""

    def __init__(self, config: BertConfig, layer_ids: Sequence[int], *, stage_index: int, num_stages: int) -> None:
        super().__init__(config)
        self.keep_stage_parts(layer_ids, stage_index, num_stages)
        if not self.is_last:
            self.final_layernorm = self.lm_head = self.output_layer = self.pooler = self.binary_head = None

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,  # type: ignore[override]
                tokentype_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                sentence_order: torch.Tensor | None = None, lm_positions: torch.Tensor | None = None):
        # The whole sequence's positions (under sequence parallelism x holds this rank's part of it).
        s = padding_mask.shape[1] if padding_mask is not None else x.shape[1]
        position_ids = torch.arange(s, device=x.device).unsqueeze(0)
        hidden = self.embed(x, position_ids, tokentype_ids) if self.is_first else x
        hidden = self.encode(hidden, position_ids, padding_attention_mask(padding_mask))
        if not self.is_last:
            return hidden
        return self.head(hidden, labels, sentence_order, lm_positions)
