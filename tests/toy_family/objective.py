"""The toy encoder's objective: from ``[b, s+1]`` token samples, classify each sequence by its first
token (mod ``num_classes``) and by the parity of its last token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from megatrain.data.batch import Batch
from megatrain.models.common.objective import Objective


@dataclass
class ClassificationBatch(Batch):
    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, 2]: class, parity
    weights: torch.Tensor  # [b] float: each sample counts once

    sequence_fields: ClassVar[tuple[str, ...]] = ("tokens",)


class ClassificationObjective(Objective):
    loss_names = ("cls loss", "parity loss")

    def __init__(self, num_classes: int = 4) -> None:
        self.num_classes = num_classes

    def make_batch(self, samples: torch.Tensor) -> ClassificationBatch:
        samples = samples.long()
        tokens = samples[:, :-1].contiguous()
        labels = torch.stack([tokens[:, 0] % self.num_classes, tokens[:, -1] % 2], dim=1)
        return ClassificationBatch(tokens, labels, torch.ones(tokens.shape[0], device=tokens.device))

    def forward(self, model: Any, batch: ClassificationBatch) -> torch.Tensor:
        return model(batch.tokens, labels=batch.labels)

    def loss_target(self, batch: ClassificationBatch) -> torch.Tensor:
        return batch.weights

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        w = target.to(output.dtype)
        return [((output[:, 0] * w).sum(), w.sum()), ((output[:, 1] * w).sum(), w.sum())]

    def stage_inputs(self, batch: ClassificationBatch, *, first: bool, last: bool) -> tuple[tuple, dict[str, Any]]:
        return ((batch.tokens,) if first else ()), {"labels": batch.labels if last else None}
