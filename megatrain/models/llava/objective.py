"""The LLaVA family's objective: Megatron's ``lm loss`` over the answer tokens only.

The loader's micro-batches are already typed (:class:`megatrain.data.multimodal.MultimodalBatch`, from
the dataset's collator): text ``tokens``/``labels`` with one placeholder per image, the answer-only
``loss_mask`` (0 on prompts, image tokens and padding) and the batch's images. The labels outside the
mask become ``IGNORE_INDEX``; the model expands each placeholder to its image's positions, moving the
labels with it, and returns the per-token loss of the expanded sequence (0 where ignored). The
expansion keeps every label the mask keeps (an image's own label moves to its last position, and the
positions whose target is a placeholder are outside the mask already), so the loss's count is the
mask's sum.

Under pipeline parallelism (``pipeline=``: the config and the run's fixed length) each micro-batch is
laid out for the stages instead (:func:`megatrain.models.llava.stage.pipeline_batch`): the first stage
takes the expanded text, its image mask, the images per row and the positions; the last stage the
expanded labels; the loss target is the expanded loss mask (the same count).
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain.models.common.objective import Objective
from megatrain.models.llava.tokens import IGNORE_INDEX

__all__ = ["LlavaObjective", "PARALLEL_REFUSAL"]

PARALLEL_REFUSAL = ("{flag} > 1 is not supported for the LLaVA family (pretrain_vlm.py): it trains in one process, "
                    "data, tensor or pipeline parallel (torchrun --nproc-per-node N)")


class LlavaObjective(Objective):
    """``lm loss``: the mean cross entropy of the answer tokens (module docstring)."""

    loss_names = ("lm loss",)
    batches_in_cuda_graph = False  # the images' count varies from batch to batch
    sparse_labels = True  # every image position and the prompts are ignored

    def __init__(self, pipeline: tuple[Any, int] | None = None) -> None:
        self.pipeline = pipeline  # (LlavaConfig, the stages' sequence length) under pipeline parallelism

    def make_batch(self, samples: Any) -> Any:
        if self.pipeline is None:
            return samples
        from megatrain.models.llava.stage import pipeline_batch

        return pipeline_batch(samples, *self.pipeline)

    def forward(self, model: Any, batch: Any) -> torch.Tensor:
        labels = batch.labels.masked_fill(batch.loss_mask == 0, IGNORE_INDEX)
        if getattr(batch, "segments", None) is None:
            return model(batch.tokens, batch.pixel_values, labels=labels)
        # packed rows: positions restart and attention stays within each sample (data/multimodal/packing.py)
        from megatrain.data.multimodal.packing import packed_attention

        position_ids, attention_mask = packed_attention(batch.segments)
        return model(batch.tokens, batch.pixel_values, position_ids, attention_mask, labels=labels)

    def loss_target(self, batch: Any) -> torch.Tensor:
        return batch.loss_mask

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(output.float().sum(), target.float().sum())]

    def stage_inputs(self, batch: Any, *, first: bool, last: bool) -> tuple[tuple, dict[str, Any]]:
        """A :class:`megatrain.models.llava.stage.LlavaPipelineBatch`'s stage inputs (module docstring)."""
        from megatrain.models.llava.stage import image_rows

        kwargs: dict[str, Any] = {"position_ids": batch.position_ids, "labels": batch.labels if last else None}
        if not first:
            return (), kwargs
        kwargs.update(image_mask=batch.image_mask, images=image_rows(batch.pixel_values, batch.image_counts),
                      image_counts=batch.image_counts)
        return (batch.tokens,), kwargs
