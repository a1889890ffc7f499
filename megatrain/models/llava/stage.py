"""One pipeline stage of a LlavaModel, under the model's own parameter names, and the fixed layout of
the language model's sequence that the stages exchange.

The first stage holds ``vision_model.*``, ``projector.*`` and the language model's embedding; the
language model's layers are split over the stages as the GPT family splits them
(:class:`megatrain.models.gpt.stage.GPTStage` is the stage's ``language_model``: its layers keep
their names ``language_model.layers.N.*``, the last stage holds the final norm and the output layer,
and with tied embeddings a copy of the word embeddings whose gradient the pipeline sums with the
first stage's).

Stages exchange tensors of one shape, so under pipeline parallelism every micro-batch is laid out
on the objective's side (:func:`pipeline_batch`) to one length ``L`` per run: the text with each
image placeholder expanded to ``tokens_per_image`` positions (:mod:`megatrain.models.llava.tokens`),
padded at the end to ``L`` (causal attention keeps the padding out of the real positions; its
labels are ignored), or cut at ``L`` as Megatron's fixed decoder length cuts it (the labels past it
dropped); under sequence parallelism ``L`` is a multiple of the tensor-parallel size and the first
stage splits its output on the sequence. The expansion is deterministic, so the labels and loss mask of that layout go straight to
the last stage, the image mask and images to the first. Images travel per row
(``[b, K, channels, img_h, img_w]``, K the most any row of the step has, zero-filled), so that the
schedule's split of the step into micro-batches keeps each row's images with it. The first stage
scatters each row's image features into its own image positions in order: the values of
:meth:`LlavaModel.embed` wherever nothing is cut.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.data.batch import Batch
from megatrain.models.gpt.model import GPTModel
from megatrain.models.gpt.stage import GPTStage
from megatrain.models.llava.config import LlavaConfig
from megatrain.models.llava.model import LlavaModel
from megatrain.models.llava.parallelize import split_sequence
from megatrain.models.llava.projector import MultimodalProjector
from megatrain.models.llava.tokens import IGNORE_INDEX, expand_image_tokens
from megatrain.models.llava.vision import VisionEncoder

__all__ = ["LlavaStage", "LlavaPipelineBatch", "pipeline_batch", "pipeline_length", "image_rows"]


def pipeline_length(config: LlavaConfig, seq_length: int, multiple: int = 1) -> int:
    """``L``, the language model's positions under pipeline parallelism: ``--seq-length`` text inputs
    with one image (``--decoder-seq-length`` when Megatron's multimodal lengths are given), rounded up
    to a ``multiple`` (the tensor-parallel size under sequence parallelism)."""
    length = seq_length - 1 + config.tokens_per_image
    return -(-length // multiple) * multiple


@dataclass
class LlavaPipelineBatch(Batch):
    """A micro-batch laid out for the stages (module docstring): every sequence field [b, L]."""

    tokens: torch.Tensor  # int64: the expanded text (image positions hold the placeholder)
    image_mask: torch.Tensor  # bool: the image positions
    labels: torch.Tensor  # int64, IGNORE_INDEX where nothing is predicted
    loss_mask: torch.Tensor  # float
    position_ids: torch.Tensor  # int64, 0 ... L-1
    pixel_values: torch.Tensor  # [N, channels, img_h, img_w], the images in reading order
    image_counts: torch.Tensor  # int64 [b]

    sequence_fields: ClassVar[tuple[str, ...]] = ("tokens", "image_mask", "labels", "loss_mask", "position_ids")


def _fit(t: torch.Tensor, length: int, value: Any) -> torch.Tensor:
    """``t`` [b, S] padded at the end with ``value``, or cut, to [b, length]."""
    return F.pad(t, (0, length - t.shape[1]), value=value) if t.shape[1] < length else t[:, :length]


def pipeline_batch(batch: Any, config: LlavaConfig, length: int) -> LlavaPipelineBatch:
    """A :class:`megatrain.data.multimodal.MultimodalBatch` laid out to ``length`` positions."""
    if getattr(batch, "segments", None) is not None:
        raise ValueError("packed rows (--packing-buffer-size) are not supported with --pipeline-model-parallel-size")
    pixel_values = batch.pixel_values
    num_images = int(pixel_values.shape[0])
    labels = batch.labels.masked_fill(batch.loss_mask == 0, IGNORE_INDEX)
    layout = expand_image_tokens(batch.tokens, num_images, image_token_id=config.image_token_id,
                                 tokens_per_image=config.tokens_per_image, pad_token_id=config.pad_token_id,
                                 labels=labels, loss_mask=batch.loss_mask)
    assert layout.labels is not None and layout.loss_mask is not None
    if bool(layout.loss_mask[:, length:].any()):  # labels past the length (cut text or images alone change nothing)
        warnings.warn(f"a row of text and images is longer than the pipeline's {length} language-model positions "
                      "(--seq-length - 1 + an image's tokens): cut there, as Megatron's --decoder-seq-length",
                      stacklevel=2)
    b = batch.tokens.shape[0]
    positions = torch.arange(length, dtype=torch.long, device=batch.tokens.device)
    lm = config.language
    if lm.position_embedding_type == "learned_absolute":  # positions rounded up past the table: padding only
        positions = positions.clamp(max=lm.max_position_embeddings - 1)
    positions = positions.expand(b, length).contiguous()
    return LlavaPipelineBatch(
        tokens=_fit(layout.tokens, length, config.pad_token_id), image_mask=_fit(layout.image_mask, length, False),
        labels=_fit(layout.labels, length, IGNORE_INDEX), loss_mask=_fit(layout.loss_mask, length, 0.0),
        position_ids=positions, pixel_values=pixel_values, image_counts=batch.image_counts.to(torch.long))


def image_rows(pixel_values: torch.Tensor, image_counts: torch.Tensor) -> torch.Tensor:
    """The images per row: [b, K, channels, img_h, img_w], K = the most of any row, zero-filled."""
    b = image_counts.shape[0]
    k = int(image_counts.max()) if b and pixel_values.shape[0] else 0
    rows = pixel_values.new_zeros((b, k, *pixel_values.shape[1:]))
    if k:
        rows[torch.arange(k, device=image_counts.device) < image_counts.unsqueeze(1)] = pixel_values
    return rows


class LlavaStage(LlavaModel):
    """``forward(x, image_mask, images, image_counts, position_ids, labels)``: on the first stage ``x``
    is the laid-out tokens [b, L] with ``images`` per row (:func:`image_rows`), elsewhere the hidden
    states [b, L, h]; the last stage returns the per-token loss [b, L] (logits without ``labels``),
    the others hidden states."""

    def __init__(self, config: LlavaConfig, layer_ids: Sequence[int], *, stage_index: int, num_stages: int) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        device = torch.empty(0).device
        with torch.device("meta"):
            self.vision_model = VisionEncoder(config.vision) if self.is_first else None
            self.projector = MultimodalProjector(config) if self.is_first else None
            self.language_model = GPTStage(config.language, layer_ids, stage_index=stage_index,
                                           num_stages=num_stages)
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights(seed=0)
        self.apply_freezing()

    def apply_freezing(self) -> None:
        cfg = self.config
        for part, frozen in ((self.language_model, cfg.freeze_language_model),
                             (self.vision_model, cfg.freeze_vision_model), (self.projector, cfg.freeze_projector)):
            for p in part.parameters() if part is not None else ():
                p.requires_grad_(not frozen)

    def layer_stacks(self) -> dict[str, nn.ModuleDict]:
        stacks = {"vision_model.layers": self.vision_model.layers} if self.vision_model is not None else {}
        return {**stacks, "language_model.layers": self.language_model.layers}

    # ---- the weights tied across the first and last stage (megatrain.models.common.stage) -----------

    @staticmethod
    def ties_first_and_last(config: LlavaConfig) -> bool:
        """The language model's tied embeddings, when they train (frozen copies stay equal as loaded)."""
        return not config.language.untie_embeddings_and_output_weights and not config.freeze_language_model

    def tied_parameters(self) -> list[torch.Tensor]:
        return self.language_model.tied_parameters() if self.ties_first_and_last(self.config) else []

    def norm_duplicates(self) -> list[torch.Tensor]:
        return self.language_model.norm_duplicates()

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """This stage's parameters (the language model's counted as its stage counts them)."""
        language = GPTModel.num_parameters(self.language_model, exclude_embeddings=exclude_embeddings)
        return language + sum(p.numel() for part in (self.vision_model, self.projector) if part is not None
                              for p in part.parameters())

    # ---- the forward pass -------------------------------------------------------------------------

    def embed_rows(self, tokens: torch.Tensor, image_mask: torch.Tensor, images: torch.Tensor,
                   image_counts: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's output before the layers [b, L, h]: the text's embeddings, each row's image
        positions (in order) replaced by its images' features (in order)."""
        text = tokens.masked_fill(image_mask, self.config.pad_token_id)
        hidden = self.language_model.embed(text, position_ids)
        present = torch.arange(images.shape[1], device=images.device) < image_counts.unsqueeze(1)
        if not bool(present.any()):
            return self.text_only_term(hidden)
        features = self.image_features(images[present])  # [N, tokens_per_image, h], reading order
        flat = features.reshape(-1, features.shape[-1]).to(hidden.dtype)
        first = (torch.cumsum(image_counts, 0) - image_counts) * self.config.tokens_per_image
        index = first.unsqueeze(1) + torch.cumsum(image_mask.long(), 1) - 1
        index = torch.where(image_mask, index, 0).clamp(max=flat.shape[0] - 1)
        return torch.where(image_mask.unsqueeze(-1), flat[index], hidden)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None,  # type: ignore[override]
                images: torch.Tensor | None = None, image_counts: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        if self.is_first:
            assert image_mask is not None and images is not None and image_counts is not None
            x = self.embed_rows(x, image_mask, images, image_counts, position_ids)
            mesh = getattr(self.language_model, "sequence_split_mesh", None)
            if mesh is not None:  # sequence parallel: the layers take this rank's part (parallelize.py)
                x = split_sequence(x, mesh)
        # GPTModel's forward on the stage's parts: the layers, then (last stage) the head
        return GPTModel.forward(self.language_model, None, position_ids, None, labels, decoder_input=x)
