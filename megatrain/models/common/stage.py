"""What pipeline stages of a model with tied input/output embeddings share: which stages hold the
two copies of the word embeddings, and which copy the gradient norm leaves out.

A family's stage class mixes in :class:`TiedEmbeddingStage` and calls :meth:`keep_stage_parts`
after building the whole model: the stage keeps its own layers; the first stage keeps the whole
embedding, the last stage (when the output weight is tied, or multi-token prediction embeds the next
tokens there) a copy of the word embeddings only, and
the other stages none. The class then drops the head parts on stages other than the last. The pipeline sums the two copies' gradients after every backward pass, as Megatron
does (``tied_parameters``), and counts the copy once in the gradient norm (``norm_duplicates``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["TiedEmbeddingStage"]


class TiedEmbeddingStage:
    """Mixin for a stage class whose model has ``embedding.word_embeddings`` and a ``config`` with
    ``untie_embeddings_and_output_weights``; the class sets ``is_first`` and ``is_last``."""

    config: Any
    embedding: Any
    layers: Any
    is_first: bool
    is_last: bool
    holds_tied_copy: bool = False

    def keep_stage_parts(self, layer_ids: Sequence[int], stage_index: int, num_stages: int) -> None:
        """Become stage ``stage_index`` of ``num_stages``: keep the layers ``layer_ids`` (deleting the
        others from ``layers``) and the embedding the stage needs."""
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        keep = {str(i) for i in layer_ids}
        for key in [k for k in self.layers.keys() if k not in keep]:
            del self.layers[key]
        self.keep_embedding_for_stage()

    def keep_embedding_for_stage(self) -> None:
        """Drop the embedding where the stage does not need it; on the last stage of a tied model keep
        the word embeddings alone (the output layer's copy)."""
        self.holds_tied_copy = False
        if self.is_first:
            return
        if self.is_last and self.ties_first_and_last(self.config):
            assert self.embedding is not None
            for name, _ in list(self.embedding.named_children()):
                if name not in ("word_embeddings", "dropout"):
                    setattr(self.embedding, name, None)
            self.holds_tied_copy = True
        else:
            self.embedding = None

    @staticmethod
    def ties_first_and_last(config: Any) -> bool:
        """Whether the first and last stages hold copies of one weight (the same on every rank): the
        tied output layer's, or the word embeddings multi-token prediction embeds with on the last stage."""
        return not config.untie_embeddings_and_output_weights or bool(getattr(config, "mtp_num_layers", 0))

    def tied_parameters(self) -> list[torch.Tensor]:
        """This stage's copies of weights tied across the first and last stage (gradients summed)."""
        if not self.ties_first_and_last(self.config) or self.embedding is None:
            return []
        return [self.embedding.word_embeddings.weight] if self.is_first or self.holds_tied_copy else []

    def norm_duplicates(self) -> list[torch.Tensor]:
        """Parameters that repeat another stage's (left out of the gradient norm)."""
        return [self.embedding.word_embeddings.weight] if self.holds_tied_copy and self.embedding is not None else []
