"""Language-model loss heads: how a model turns its final (normed) hidden states and the labels into
the per-token loss.

A model with a language-model head holds one in its ``loss_head`` slot (the plain
:class:`LogitsCrossEntropy` unless parallel code picks another): the chunked float32 cross entropy
(:class:`megatrain.runtime.fused_loss.ChunkedCrossEntropy`, ``--cross-entropy-chunk-size``) and the
vocab-parallel one under tensor parallelism
(:class:`megatrain.parallel.tensor_parallel.VocabParallelLoss`) follow the same protocol.
``megatrain.parallel.parallelize`` chooses the head and returns it with what else it built.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = ["LossHead", "LanguageModelOutput", "LogitsCrossEntropy", "per_token_cross_entropy"]


class LanguageModelOutput(Protocol):
    """What a loss head reads from its model."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # normed hidden [.., h] -> logits [.., V]

    def output_weight(self) -> torch.Tensor: ...  # the output layer's weight [V, h]

    def output_bias(self) -> torch.Tensor | None: ...  # the output layer's bias [V] (BERT's), or None


class LossHead(Protocol):
    def per_token_loss(self, model: LanguageModelOutput, hidden: torch.Tensor,
                       labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss (float32, the shape of ``labels``; labels of -100 give 0) from the final
        normed hidden states."""
        ...


def per_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy [b, s] in float32 (labels of -100 give 0)."""
    per_token = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none")
    return per_token.view(labels.shape)


class LogitsCrossEntropy:
    """The plain head: the logits in the compute dtype, then float32 cross entropy."""

    def per_token_loss(self, model: LanguageModelOutput, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return per_token_cross_entropy(model.logits(hidden), labels)

    def __repr__(self) -> str:
        return "LogitsCrossEntropy()"
