"""Token embeddings, plus learned absolute position embeddings (GPT-2 / BERT style)."""

from __future__ import annotations

import torch
from torch import nn

from megatrain.models.common.config import TransformerConfig

__all__ = ["Embedding"]


class Embedding(nn.Module):
    """Token embeddings, plus learned absolute position embeddings for GPT-2 style models."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "learned_absolute"
            else None
        )
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            hidden = hidden + self.position_embeddings(position_ids)
        return self.dropout(hidden)
