"""Batches of multimodal samples: text padded to the batch's longest (or a fixed length), the images
stacked, and how many images each sample has, so that text-only and image samples mix.

From samples of :class:`megatrain.data.multimodal.llava_dataset.LlavaJsonlDataset` (or the energon
reader), each ``tokens``/``targets`` int64 [n_i] and ``pixel_values`` [k_i, 3, H, W]:

* the rows are padded with ``pad_id`` to ``L = max n_i`` (or to ``seq_length + 1`` when given, so every
  batch has one shape); ``tokens = ids[:, :-1]``, ``labels = ids[:, 1:]``, ``loss_mask = targets[:, 1:]``
  (0 on padding, prompts and image tokens), ``position_ids`` 0, 1, ... per row;
* ``pixel_values`` [sum k_i, 3, H, W]: the batch's images in sample order (empty ``[0, 3, H, W]`` when
  it has none), ``image_counts`` [b]: k_i. Sample ``r``'s images are ``pixel_values[offset_r:offset_r
  + k_r]`` with ``offset_r = image_counts[:r].sum()``; in ``tokens`` they sit where ``image_token_id``
  is (one id per image, or the pre-expanded run);
* ``attention_mask`` is None: padding sits at the end of each row, so causal attention already keeps
  it away from the real tokens (as megatrain's SFT batches); ``lengths`` [b] are the rows' real input
  lengths for a model that wants them;
* packed rows (samples with ``segments``, :mod:`megatrain.data.multimodal.packing`): ``segments``
  [b, S] numbers the sample (1, 2, ...; 0 on padding) of every position of the sequence the language
  model runs, each image expanded to ``tokens_per_image`` positions; None for unpacked batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import numpy as np
import torch

from megatrain.data.batch import Batch
from megatrain.data.multimodal.packing import expand_segments

__all__ = ["MultimodalBatch", "MultimodalCollator"]


@dataclass
class MultimodalBatch(Batch):
    """A micro-batch of text with images (module docstring). ``pixel_values`` and ``image_counts``
    concatenate over micro-batches as the rows do (dim 0), so :meth:`Batch.cat` keeps them matched."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    pixel_values: torch.Tensor
    image_counts: torch.Tensor
    lengths: torch.Tensor
    attention_mask: Optional[torch.Tensor] = None
    segments: Optional[torch.Tensor] = None  # packed rows: [b, S] over the expanded sequence

    sequence_fields: ClassVar[tuple[str, ...]] = ("tokens", "labels", "loss_mask", "position_ids")

    @property
    def image_offsets(self) -> torch.Tensor:
        """Index of each row's first image in ``pixel_values``."""
        return torch.cumsum(self.image_counts, 0) - self.image_counts


class MultimodalCollator:
    """``collate_fn`` for a DataLoader of multimodal samples (picklable, for loader workers).

    ``pad_id``: the pad token (the tokenizer's pad, else its eod). ``seq_length``: pad every batch to
    ``seq_length`` inputs (None: to the batch's longest). ``image_shape``: (3, H, W) of the images, for
    the empty ``pixel_values`` of a batch without images (None: taken from a sample; a batch with no
    image then gets ``[0, 3, 0, 0]``). ``tokens_per_image`` and ``image_token_id``: how the model expands
    an image, for the ``segments`` of packed samples (needed only for them)."""

    def __init__(self, pad_id: int, seq_length: int | None = None, image_shape: Sequence[int] | None = None,
                 tokens_per_image: int | None = None, image_token_id: int | None = None):
        self.pad_id = int(pad_id)
        self.seq_length = None if seq_length is None else int(seq_length)
        self.image_shape = tuple(image_shape) if image_shape is not None else None
        self.tokens_per_image, self.image_token_id = tokens_per_image, image_token_id

    def __call__(self, samples: Sequence[dict[str, Any]]) -> MultimodalBatch:
        if not samples:
            raise ValueError("cannot collate an empty batch")
        rows = [np.asarray(s["tokens"], dtype=np.int64) for s in samples]
        longest = max(len(r) for r in rows)
        width = longest if self.seq_length is None else self.seq_length + 1
        if longest > width:
            raise ValueError(f"a sample has {longest} tokens, more than seq_length + 1 = {width}")
        if width < 2:
            raise ValueError("samples need at least 2 tokens (an input and a label)")
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        targets = np.zeros((len(rows), width), dtype=np.int64)
        for r, (row, s) in enumerate(zip(rows, samples)):
            ids[r, :len(row)] = row
            targets[r, :len(row)] = np.asarray(s["targets"], dtype=np.int64)
        packed = ["segments" in s for s in samples]
        segments = np.zeros((len(rows), width), dtype=np.int64) if any(packed) else None
        if segments is not None:
            if not all(packed):
                raise ValueError("cannot collate packed samples (with segments) and unpacked ones together")
            if self.tokens_per_image is None or self.image_token_id is None:
                raise ValueError("packed samples need the collator's tokens_per_image and image_token_id")
            for r, (row, s) in enumerate(zip(rows, samples)):
                segments[r, :len(row)] = np.asarray(s["segments"], dtype=np.int64)
        ids_t, targets_t = torch.from_numpy(ids), torch.from_numpy(targets)
        images = [torch.as_tensor(s["pixel_values"], dtype=torch.float32) for s in samples]
        counts = torch.tensor([int(i.shape[0]) for i in images], dtype=torch.int64)
        for s, i in zip(samples, images):
            if int(s.get("num_images", i.shape[0])) != i.shape[0]:
                raise ValueError(f"sample {s.get('id')} says num_images={s['num_images']} but has {i.shape[0]}")
        present = [i for i in images if i.shape[0]]
        if present:
            pixel_values = torch.cat(present)
        else:
            shape = self.image_shape or (tuple(images[0].shape[1:]) if images[0].dim() == 4 else (3, 0, 0))
            pixel_values = torch.empty((0, *shape), dtype=torch.float32)
        seq = width - 1
        lengths = torch.tensor([min(len(r), width) - 1 for r in rows], dtype=torch.int64)
        tokens = ids_t[:, :-1].contiguous()
        expanded = None
        if segments is not None:  # the input positions' samples, laid out as the model expands the images
            expanded = expand_segments(tokens, torch.from_numpy(segments[:, :-1]), int(counts.sum()),
                                       int(self.image_token_id), int(self.tokens_per_image))
        return MultimodalBatch(
            tokens=tokens, labels=ids_t[:, 1:].contiguous(),
            loss_mask=targets_t[:, 1:].float().contiguous(),
            position_ids=torch.arange(seq, dtype=torch.int64).expand(len(rows), seq).contiguous(),
            pixel_values=pixel_values, image_counts=counts, lengths=lengths, segments=expanded)
