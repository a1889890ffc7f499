"""Token embeddings, plus learned absolute position embeddings (GPT-2 / BERT style) and token-type
(segment) embeddings (BERT style)."""

from __future__ import annotations

import torch
from torch import nn

from megatrain.models.common.config import TransformerConfig

__all__ = ["Embedding"]


class Embedding(nn.Module):
    """``word_embeddings``, plus ``position_embeddings`` for learned absolute positions and
    ``tokentype_embeddings`` when ``num_tokentypes`` > 0 (BERT's segments A/B); their sum, then
    dropout (Megatron's ``LanguageModelEmbedding``)."""

    def __init__(self, config: TransformerConfig, num_tokentypes: int = 0) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "learned_absolute"
            else None
        )
        self.tokentype_embeddings = nn.Embedding(num_tokentypes, config.hidden_size) if num_tokentypes > 0 else None
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            hidden = hidden + self.position_embeddings(position_ids)
        if self.tokentype_embeddings is not None:  # no ids: every token is of type 0
            hidden = hidden + (self.tokentype_embeddings(tokentype_ids) if tokentype_ids is not None
                               else self.tokentype_embeddings.weight[0])
        return self.dropout(hidden)
