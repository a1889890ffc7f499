"""Weighted blending of several datasets, in Megatron-LM's exact sample order.

Sample ``i`` of a blend comes from dataset ``d_i = argmax_d(w_d * max(i, 1) - c_d(i))`` (first
maximum wins), where ``c_d(i)`` counts the earlier samples taken from ``d``; it is that
dataset's sample number ``c_d(i)``. The arithmetic is float64 exactly as in Megatron's
``build_blending_indices``, so the two agree bit for bit.

The rule is sequential, but its state forgets where it started within a few steps: two runs
from different counts fall into the same sequence almost at once. `build_blending_indices`
uses that to simulate many segments of the sequence side by side (each segment starts a little
early from an estimated state), then *verifies* the whole result against the rule in
vectorised form. Verification is a proof: when every pick equals the rule's pick given the
picks before it, the sequence is the rule's sequence by induction. Where a pick disagrees,
everything before it is known correct, the pick is corrected and the remainder recomputed
from that exact state with a longer warm-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from typing import Sequence

import numpy as np

__all__ = ["BlendedDataset", "build_blending_indices", "normalize_weights"]

logger = logging.getLogger(__name__)

_VERIFY_CHUNK = 1 << 20


def normalize_weights(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum in float64 (Megatron's ``normalize``)."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def _estimated_counts(weights: np.ndarray, position: int) -> np.ndarray:
    """Counts close to the rule's state at ``position``: largest remainders of w*position."""
    target = weights * position
    counts = np.floor(target).astype(np.int64)
    missing = position - int(counts.sum())
    if missing > 0:
        order = np.argsort(-(target - counts), kind="stable")
        counts[order[:missing]] += 1
    return counts


def _simulate(weights: np.ndarray, out: np.ndarray, start: int, counts0: np.ndarray,
              warmup: int, num_segments: int) -> None:
    """Fill ``out[start:]`` by simulating segments side by side (unverified)."""
    size = out.shape[0]
    remaining = size - start
    num_segments = max(1, min(num_segments, remaining // max(4 * warmup, 1) or 1))
    seg_len = -(-remaining // num_segments)
    num_segments = -(-remaining // seg_len)
    region_start = start + seg_len * np.arange(num_segments, dtype=np.int64)
    warm = np.full(num_segments, warmup, dtype=np.int64)
    warm[0] = 0
    sim_start = region_start - warm
    counts = np.empty((num_segments, weights.shape[0]), dtype=np.int64)
    counts[0] = counts0
    for m in range(1, num_segments):
        counts[m] = _estimated_counts(weights, int(sim_start[m]))
    rows = np.arange(num_segments)
    region_end = np.minimum(region_start + seg_len, size)
    for t in range(warmup + seg_len):
        pos = sim_start + t
        step = np.maximum(pos, 1).astype(np.float64)
        errors = weights[None, :] * step[:, None] - counts
        pick = np.argmax(errors, axis=1)
        counts[rows, pick] += 1
        write = (pos >= region_start) & (pos < region_end)
        out[pos[write]] = pick[write]


def _verify(weights: np.ndarray, out: np.ndarray, start: int, counts0: np.ndarray,
            sample_index: np.ndarray) -> int:
    """Check ``out[start:]`` against the rule; fill ``sample_index``. Return the first bad position or -1."""
    counts = counts0.astype(np.int64).copy()
    num = weights.shape[0]
    for lo in range(start, out.shape[0], _VERIFY_CHUNK):
        hi = min(lo + _VERIFY_CHUNK, out.shape[0])
        picks = out[lo:hi].astype(np.int64)
        onehot = np.zeros((hi - lo, num), dtype=np.int64)
        onehot[np.arange(hi - lo), picks] = 1
        before = np.cumsum(onehot, axis=0)
        before -= onehot
        before += counts
        step = np.maximum(np.arange(lo, hi, dtype=np.int64), 1).astype(np.float64)
        errors = weights[None, :] * step[:, None] - before
        expected = np.argmax(errors, axis=1)
        bad = np.nonzero(expected != picks)[0]
        if bad.size:
            first = int(bad[0])
            sample_index[lo:lo + first] = before[np.arange(first), picks[:first]]
            out[lo + first] = expected[first]
            return lo + first
        sample_index[lo:hi] = before[np.arange(hi - lo), picks]
        counts = before[-1] + onehot[-1]
    return -1


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blending order for ``size`` samples.

    Returns ``(dataset_index int16[size], dataset_sample_index int64[size])``. ``weights``
    are used as given (normalise them first, as Megatron does).
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or w.size >= 32767:
        raise ValueError(f"blending needs 1 to 32766 weights, got {w.size}")
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    if size == 0:
        return dataset_index, dataset_sample_index
    if w.size == 1:
        dataset_sample_index[:] = np.arange(size)
        return dataset_index, dataset_sample_index
    start, counts = 0, np.zeros(w.size, dtype=np.int64)
    warmup = 64
    segments = max(1, min(4096, size // 512))
    while start < size:
        _simulate(w, dataset_index, start, counts, warmup, segments)
        bad = _verify(w, dataset_index, start, counts, dataset_sample_index)
        if bad < 0:
            break
        # out[:bad] is verified and out[bad] corrected: resume right after it.
        counts = np.bincount(dataset_index[: bad + 1].astype(np.int64), minlength=w.size).astype(np.int64)
        dataset_sample_index[bad] = counts[dataset_index[bad]] - 1
        start = bad + 1
        warmup *= 2
        logger.debug("blending: resimulating from %d with warm-up %d", start, warmup)
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Samples drawn from several datasets in Megatron's weighted order.

    ``datasets`` are map-style datasets (``GPTDataset``); ``weights`` are normalised here
    (as Megatron does); ``size`` is the number of samples. Indices are cached as
    ``{md5}-BlendedDataset-{split}-{dataset_index,dataset_sample_index}.npy`` under
    ``cache_dir`` (``None``: no cache).
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int,
                 cache_dir: str | None, split_name: str = "train"):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if any(float(x) <= 0 for x in weights):
            raise ValueError(f"blend weights must be positive, got {list(weights)}")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = int(size)
        self.split_name = split_name
        ids = OrderedDict()
        ids["class"] = "BlendedDataset"
        ids["datasets"] = [getattr(d, "unique_identifiers", repr(d)) for d in self.datasets]
        ids["split"] = split_name
        ids["weights"] = self.weights
        ids["size"] = self.size
        self.unique_description = json.dumps(ids, indent=4)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()

        from megatrain.data.gpt_dataset import load_or_build_cached

        def build():
            di, dsi = build_blending_indices(self.weights, self.size)
            return {"dataset_index": di, "dataset_sample_index": dsi}

        arrays = load_or_build_cached(
            cache_dir, f"{self.unique_description_hash}-BlendedDataset-{split_name}",
            ("dataset_index", "dataset_sample_index"), self.unique_description, build)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for d, dataset in enumerate(self.datasets):
            used = self.dataset_sample_index[self.dataset_index == d]
            if used.size and int(used.max()) >= len(dataset):
                raise RuntimeError(
                    f"blended dataset needs sample {int(used.max())} of dataset {d} which has "
                    f"only {len(dataset)}; raise --mid-level-dataset-surplus")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        if not -self.size <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]
