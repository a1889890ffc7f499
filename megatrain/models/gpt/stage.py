"""One pipeline stage of a GPTModel, under the model's own parameter names.

A stage is a GPTModel with the layers it does not own deleted from its ``layers`` ModuleDict and the
parts it does not own set to None, so every parameter keeps its canonical name
(``layers.7.mlp.linear_fc1.weight``) for ``initial_value`` and checkpoints. The embedding belongs
to the first stage; the final norm, output layer and loss to the last.

Tied input/output embeddings (the default): the last stage keeps its own copy of
``embedding.word_embeddings.weight`` for the output layer, initialised from the same
``initial_value``; the pipeline sums the gradients of the two copies after every backward pass
(:meth:`GPTStage.tied_parameters`), as Megatron does, so they stay identical; the copy counts
once in the gradient norm (:meth:`GPTStage.norm_duplicates`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatrain.models.common.rope import rotary_tables
from megatrain.models.common.stage import TiedEmbeddingStage
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt.model import GPTModel

__all__ = ["GPTStage"]


class GPTStage(TiedEmbeddingStage, GPTModel):
    """``forward(x, position_ids, attention_mask, labels)``: ``x`` is token ids on the first stage
    and hidden states [b, s, h] (the local sequence part under sequence parallelism) elsewhere;
    the last stage returns the per-token loss [b, s] (logits without ``labels``), the others
    hidden states.
    """

    def __init__(self, config: GPTConfig, layer_ids: Sequence[int], *, stage_index: int, num_stages: int) -> None:
        super().__init__(config)
        self.keep_stage_parts(layer_ids, stage_index, num_stages)
        if not self.is_last:
            self.final_layernorm = None
            self.output_layer = None
            self.mtp = None  # the prediction depths run on the last stage (with a copy of the word embeddings)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,  # type: ignore[override]
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **mtp_targets: torch.Tensor) -> torch.Tensor:
        """``mtp_targets``: on the last stage, the multi-token prediction batch fields, one keyword each."""
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        hidden = self.embed(x, position_ids) if self.is_first else x
        rotary = rotary_tables(self.config, position_ids)  # once for all layers of the stage
        for layer in self.layers.values():
            hidden = layer(hidden, position_ids, attention_mask, rotary=rotary)
        if not self.is_last:
            return hidden
        if labels is None:
            return self.head(hidden)
        return self.head_with_mtp(hidden, labels, mtp_targets or None, position_ids, attention_mask, rotary)
