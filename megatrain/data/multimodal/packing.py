"""Packing of multimodal samples: several short samples (text-only and image ones) in one row of the
micro-batch, as Megatron-LM's multimodal example does (``--packing-buffer-size``,
``--packing-seq-length``; its task encoder's ``select_samples_to_pack`` and ``pack_selected_samples``).

* **Cost** of a sample: the positions it takes in the language model's sequence, Megatron's
  ``total_len``: its tokens with each image's placeholder counted as ``tokens_per_image`` positions.
* **Fit**: a sample costing more than ``packing_seq_length`` is cut as Megatron's
  ``_truncate_for_packing`` cuts it: its text to ``packing_seq_length`` less the images' extra positions.
  A cut that would reach an image, or leave no target, is one line naming ``--packing-seq-length``
  and the sample's file and line.
* **Buffers**: the underlying samples are read in their order in consecutive buffers of
  ``buffer_size`` (``[k B, (k + 1) B)``, energon's packing buffer); each buffer is split into packs by
  Megatron's greedy knapsack (largest sample that still fits first, ``packing_seq_length`` per pack) and
  its packs follow the previous buffer's. A pack's samples are concatenated in the knapsack's order.
* **A sample of the packed dataset is one pack** (one row of a micro-batch), so ``--global-batch-size``
  and the checkpoint's consumed-sample count count packs, as Megatron's energon loader counts them. Pack
  ``j`` depends only on the underlying order and the two flags: the packed order is deterministic and a
  resume from the consumed count rebuilds the same packs (measuring the samples of the buffers before it
  again; the jsonl's text only, without images).

In a packed row (:func:`pack_selected_samples`) ``segments`` numbers each token's sample (1, 2, ...), and
each sample's first target is cleared (nothing predicts across a boundary). The collator expands the
segments with the images (:func:`expand_segments`); :func:`packed_attention` turns them into the language
model's position ids (restarting at 0 for every sample) and block-diagonal causal attention mask, the
same rule as the SFT packing's ``sft_batch`` (``True`` = may attend).
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

import numpy as np
import torch

from megatrain.data.batch import packed_attention
from megatrain.data.multimodal.errors import MultimodalDataError

__all__ = ["PackedSamples", "sample_cost", "fit_for_packing", "select_samples_to_pack", "pack_selected_samples",
           "expand_segments", "packed_attention"]


def sample_cost(tokens: np.ndarray, num_images: int, image_token_id: int, tokens_per_image: int) -> int:
    """Positions of a sample in the language model's sequence (Megatron's ``total_len``): its tokens with
    each image taking ``tokens_per_image`` positions (one placeholder each, or already that many)."""
    placeholders = int((np.asarray(tokens) == image_token_id).sum())
    return len(tokens) + num_images * tokens_per_image - placeholders


def fit_for_packing(sample: dict[str, Any], capacity: int, image_token_id: int, tokens_per_image: int,
                    where: str) -> dict[str, Any]:
    """``sample`` cut to cost at most ``capacity`` (Megatron's ``_truncate_for_packing``); the same dict
    when it fits. A cut into an image's tokens, or one that leaves no target, raises one line."""
    tokens = np.asarray(sample["tokens"])
    k = int(sample["num_images"])
    cost = sample_cost(tokens, k, image_token_id, tokens_per_image)
    if cost <= capacity:
        return sample
    keep = capacity - (cost - len(tokens))  # the text tokens that fit next to the images' positions
    is_image = tokens == image_token_id
    if k and (keep < 1 or is_image[keep:].any()):
        raise MultimodalDataError(
            f"takes {cost} positions with its {k} image(s) ({tokens_per_image} each), more than --packing-seq-length "
            f"{capacity}, and its text cut to fit would cut into its images: raise --packing-seq-length or shorten "
            "the text before the images", where, "length")
    targets = np.asarray(sample["targets"])[:max(keep, 0)]
    if keep < 2 or not targets[1:].any():
        raise MultimodalDataError(
            f"takes {cost} positions, more than --packing-seq-length {capacity}, and cut to it keeps no answer "
            "token: raise --packing-seq-length", where, "length")
    return {**sample, "tokens": tokens[:keep], "targets": targets}


def select_samples_to_pack(costs: Sequence[int], capacity: int) -> list[list[int]]:
    """Megatron's ``greedy_knapsack``: the buffer's positions grouped into packs of total cost at most
    ``capacity``; each pack takes the largest remaining sample that still fits (of equal ones the later),
    until none does. Every cost must be at most ``capacity``."""
    order = sorted(range(len(costs)), key=lambda i: costs[i])  # stable: ties keep buffer order
    sizes = [int(costs[i]) for i in order]
    if sizes and sizes[-1] > capacity:
        raise ValueError(f"a sample costs {sizes[-1]} positions, more than the packing capacity {capacity}")
    packs = []
    while sizes:
        pack, room = [], capacity
        while True:
            at = bisect.bisect(sizes, room) - 1
            if at < 0:
                break
            room -= sizes.pop(at)
            pack.append(order.pop(at))
        packs.append(pack)
    return packs


def pack_selected_samples(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One packed sample of ``samples`` in order: tokens, targets (each sample's first cleared) and
    ``segments`` (int64, the sample number of each token: 1, 2, ...) concatenated, the images in order."""
    targets = []
    for s in samples:
        t = np.array(s["targets"], dtype=np.int64)
        t[:1] = 0
        targets.append(t)
    pixels = [torch.as_tensor(s["pixel_values"], dtype=torch.float32) for s in samples]
    segments = [np.full(len(s["tokens"]), n, dtype=np.int64) for n, s in enumerate(samples, 1)]
    return {"tokens": np.concatenate([np.asarray(s["tokens"], dtype=np.int64) for s in samples]),
            "targets": np.concatenate(targets), "segments": np.concatenate(segments),
            "pixel_values": torch.cat(pixels), "num_images": sum(int(s["num_images"]) for s in samples),
            "id": ",".join(str(s.get("id")) for s in samples),
            "skipped": sum(int(s.get("skipped", 0)) for s in samples), "packed": len(samples)}


def expand_segments(tokens: torch.Tensor, segments: torch.Tensor, num_images: int, image_token_id: int,
                    tokens_per_image: int) -> torch.Tensor:
    """``segments`` [b, s] of the text ``tokens`` -> [b, S] of the sequence with each image expanded as
    :func:`megatrain.models.llava.tokens.expand_image_tokens` lays it out (rows padded with 0)."""
    is_image = tokens == image_token_id
    count = int(is_image.sum())
    if count == num_images * tokens_per_image:
        repeats = torch.ones_like(tokens)
    elif count == num_images:
        repeats = torch.where(is_image, tokens_per_image, 1)
    else:
        raise ValueError(f"the text holds {count} image tokens (id {image_token_id}) for {num_images} images: "
                         f"expected one per image, or {tokens_per_image} per image (already expanded)")
    rows = [torch.repeat_interleave(seg, rep) for seg, rep in zip(segments, repeats)]
    out = torch.zeros((len(rows), max((len(r) for r in rows), default=0)), dtype=torch.int64)
    for r, row in enumerate(rows):
        out[r, :len(row)] = row
    return out


class PackedSamples(torch.utils.data.Dataset):
    """``num_samples`` packs of ``dataset``'s samples (module docstring); pack ``j`` is its ``j``-th.

    ``dataset``: a map-style dataset of multimodal samples (``tokens``, ``targets``, ``pixel_values``,
    ``num_images``), long enough for every buffer read (``num_samples * buffer_size`` is always enough).
    A ``text_sample(i)`` method (the jsonl dataset's) measures sample ``i`` without its images; otherwise
    each buffer's samples are read whole once and kept while its packs are read."""

    def __init__(self, dataset: Any, *, packing_seq_length: int, buffer_size: int, tokens_per_image: int,
                 image_token_id: int, num_samples: int):
        if buffer_size < 1 or packing_seq_length < 2:
            raise ValueError(f"packing needs --packing-buffer-size >= 1 and --packing-seq-length >= 2, got "
                             f"{buffer_size} and {packing_seq_length}")
        self.dataset, self.capacity, self.buffer_size = dataset, int(packing_seq_length), int(buffer_size)
        self.tokens_per_image, self.image_token_id = int(tokens_per_image), int(image_token_id)
        self.num_samples = int(num_samples)
        self.collate_fn = getattr(dataset, "collate_fn", None)
        self._packs: list[list[list[int]]] = []  # buffer k -> its packs (underlying indices)
        self._first = [0]  # pack index of buffer k's first pack
        self._whole: dict[int, dict[str, Any]] = {}  # the current buffer's whole samples (no text_sample)

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_whole": {}}

    def _where(self, sample: dict[str, Any]) -> str:
        if sample.get("where"):
            return str(sample["where"])
        ds = self.dataset
        return f"{getattr(ds, 'flag', '--data-path')} {getattr(ds, 'path', '')}: sample {sample.get('id')}"

    def _fit(self, sample: dict[str, Any]) -> dict[str, Any]:
        return fit_for_packing(sample, self.capacity, self.image_token_id, self.tokens_per_image, self._where(sample))

    def _read(self, i: int) -> dict[str, Any]:
        sample = self._whole.get(i)
        return sample if sample is not None else self._fit(self.dataset[i])

    def _pack_buffer(self) -> None:
        """Packs of the next buffer."""
        k = len(self._packs)
        start, stop = k * self.buffer_size, min((k + 1) * self.buffer_size, len(self.dataset))
        if start >= stop:
            raise IndexError(f"the packed dataset needs more than the {len(self.dataset)} samples it wraps")
        measure = getattr(self.dataset, "text_sample", None)
        if measure is None:
            self._whole = {i: self._fit(self.dataset[i]) for i in range(start, stop)}
            texts = [self._whole[i] for i in range(start, stop)]
        else:
            texts = [self._fit(measure(i)) for i in range(start, stop)]
        costs = [sample_cost(s["tokens"], int(s["num_images"]), self.image_token_id, self.tokens_per_image)
                 for s in texts]
        packs = [[start + p for p in pack] for pack in select_samples_to_pack(costs, self.capacity)]
        self._packs.append(packs)
        self._first.append(self._first[-1] + len(packs))

    def pack_indices(self, index: int) -> list[int]:
        """The underlying sample indices of pack ``index``, in their order in the row."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"pack {index} out of range for {self.num_samples} packs")
        while self._first[-1] <= index:
            self._pack_buffer()
        k = bisect.bisect_right(self._first, index) - 1
        return self._packs[k][index - self._first[k]]

    def __getitem__(self, index: int) -> dict[str, Any]:
        indices = self.pack_indices(int(index))
        return pack_selected_samples([self._read(i) for i in indices])
