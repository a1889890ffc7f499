"""The LLaVA family's objective: Megatron's ``lm loss`` over the answer tokens only.

The loader's micro-batches are already typed (:class:`megatrain.data.multimodal.MultimodalBatch`, from
the dataset's collator): text ``tokens``/``labels`` with one placeholder per image, the answer-only
``loss_mask`` (0 on prompts, image tokens and padding) and the batch's images. The labels outside the
mask become ``IGNORE_INDEX``; the model expands each placeholder to its image's positions, moving the
labels with it, and returns the per-token loss of the expanded sequence (0 where ignored). The
expansion keeps every label the mask keeps (an image's own label moves to its last position, and the
positions whose target is a placeholder are outside the mask already), so the loss's count is the
mask's sum.

The expansion runs on the host, before the micro-batch moves (``host_batch``): its length and the
placeholders' count follow from the text's values, which on the device would make the host wait for
the device at every micro-batch (and lose the lead it keeps over the device's queue). The model then
takes the laid-out text with its image mask (``LlavaModel.forward(image_mask=...)``).

Under pipeline parallelism (``pipeline_length``: the run's fixed length) each micro-batch is laid out for
the stages instead (:func:`megatrain.models.llava.stage.pipeline_batch`): the first stage takes the
expanded text, its image mask, the images per row and the positions; the last stage the expanded
labels; the loss target is the expanded loss mask (the same count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from megatrain.data.batch import Batch
from megatrain.models.common.objective import Objective
from megatrain.models.llava.config import LlavaConfig
from megatrain.models.llava.stage import LlavaPipelineBatch, pipeline_batch
from megatrain.models.llava.tokens import IGNORE_INDEX, expand_image_tokens

__all__ = ["LlavaLaidOutBatch", "LlavaObjective", "PARALLEL_REFUSAL"]

PARALLEL_REFUSAL = ("{flag} > 1 is not supported for the LLaVA family (pretrain_vlm.py): it trains in one process, "
                    "data, tensor or pipeline parallel (torchrun --nproc-per-node N)")


@dataclass
class LlavaLaidOutBatch(Batch):
    """A :class:`megatrain.data.multimodal.MultimodalBatch` with its image placeholders expanded
    (module docstring): the sequence fields [b, S], S the expanded length."""

    tokens: torch.Tensor  # int64: the expanded text (image positions hold the placeholder)
    image_mask: torch.Tensor  # bool: the image positions, in reading order
    labels: torch.Tensor  # int64, IGNORE_INDEX where nothing is predicted
    loss_mask: torch.Tensor  # float [b, s]: the text's own (unexpanded) answer mask, the loss's count
    pixel_values: torch.Tensor  # [N, channels, img_h, img_w]
    segments: Optional[torch.Tensor] = None  # packed rows: [b, S]

    sequence_fields: ClassVar[tuple[str, ...]] = ("tokens", "image_mask", "labels")


class LlavaObjective(Objective):
    """``lm loss``: the mean cross entropy of the answer tokens (module docstring)."""

    loss_names = ("lm loss",)
    batches_in_cuda_graph = False  # the images' count varies from batch to batch
    sparse_labels = True  # every image position and the prompts are ignored

    def __init__(self, config: LlavaConfig, pipeline_length: int | None = None) -> None:
        self.config = config  # the placeholder id, tokens per image and pad id of the expansion
        self.pipeline_length = pipeline_length  # the stages' sequence length under pipeline parallelism

    def host_batch(self, samples: Any) -> Any:
        if self.pipeline_length is not None:
            return pipeline_batch(samples, self.config, self.pipeline_length)
        cfg = self.config
        layout = expand_image_tokens(samples.tokens, samples.pixel_values.shape[0], image_token_id=cfg.image_token_id,
                                     tokens_per_image=cfg.tokens_per_image, pad_token_id=cfg.pad_token_id,
                                     labels=samples.labels.masked_fill(samples.loss_mask == 0, IGNORE_INDEX))
        assert layout.labels is not None
        return LlavaLaidOutBatch(tokens=layout.tokens, image_mask=layout.image_mask, labels=layout.labels,
                                 loss_mask=samples.loss_mask, pixel_values=samples.pixel_values,
                                 segments=getattr(samples, "segments", None))

    def make_batch(self, samples: Any) -> Any:
        if isinstance(samples, (LlavaLaidOutBatch, LlavaPipelineBatch)):
            return samples
        return self.host_batch(samples)  # a caller that moved the loader's samples itself: laid out there

    def forward(self, model: Any, batch: Any) -> torch.Tensor:
        batch = self.make_batch(batch)
        if batch.segments is None:
            return model(batch.tokens, batch.pixel_values, labels=batch.labels, image_mask=batch.image_mask)
        # packed rows: positions restart and attention stays within each sample (data/multimodal/packing.py)
        from megatrain.data.multimodal.packing import packed_attention

        position_ids, attention_mask = packed_attention(batch.segments)
        return model(batch.tokens, batch.pixel_values, position_ids, attention_mask, labels=batch.labels,
                     image_mask=batch.image_mask)

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
