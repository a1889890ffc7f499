"""The LLaVA family's objective: Megatron's ``lm loss`` over the answer tokens only.

The loader's micro-batches are already typed (:class:`megatrain.data.multimodal.MultimodalBatch`, from
the dataset's collator): text ``tokens``/``labels`` with one placeholder per image, the answer-only
``loss_mask`` (0 on prompts, image tokens and padding) and the batch's images. The labels outside the
mask become ``IGNORE_INDEX``; the model expands each placeholder to its image's positions, moving the
labels with it, and returns the per-token loss of the expanded sequence (0 where ignored). The
expansion keeps every label the mask keeps (an image's own label moves to its last position, and the
positions whose target is a placeholder are outside the mask already), so the loss's count is the
mask's sum.
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain.models.common.objective import Objective
from megatrain.models.llava.tokens import IGNORE_INDEX

__all__ = ["LlavaObjective", "PARALLEL_REFUSAL"]

PARALLEL_REFUSAL = ("{flag} > 1 is not supported for the LLaVA family (pretrain_vlm.py): it trains in one process "
                    "or data parallel (torchrun --nproc-per-node N, --use-distributed-optimizer)")


class LlavaObjective(Objective):
    """``lm loss``: the mean cross entropy of the answer tokens (module docstring)."""

    loss_names = ("lm loss",)
    batches_in_cuda_graph = False  # the images' count varies from batch to batch

    def make_batch(self, samples: Any) -> Any:
        return samples

    def forward(self, model: Any, batch: Any) -> torch.Tensor:
        labels = batch.labels.masked_fill(batch.loss_mask == 0, IGNORE_INDEX)
        return model(batch.tokens, batch.pixel_values, labels=labels)

    def loss_target(self, batch: Any) -> torch.Tensor:
        return batch.loss_mask

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(output.float().sum(), target.float().sum())]

    def stage_inputs(self, batch: Any, *, first: bool, last: bool) -> tuple[tuple, dict[str, Any]]:
        raise ValueError(PARALLEL_REFUSAL.format(flag="--pipeline-model-parallel-size"))
