"""Megatron-LM's split and blend rules for every dataset family, and the index cache.

`build_split_datasets` turns the data flags of a `DataConfig` (``--data-path`` as one prefix, a
weighted blend ``W1 P1 W2 P2 ...`` or several unweighted prefixes, split by ``--split``; or
``--train/valid/test-data-path``) into ``(train, valid, test)``, as Megatron's
``BlendedMegatronDatasetBuilder`` does, given two things of the dataset family:

* ``numel(indexed)``: the number of elements ``--split`` divides (GPT: sequences; BERT:
  documents), split ``i`` taking elements ``[round(b_i * numel), round(b_{i+1} * numel))``;
* ``make(indexed, prefix, indices, num_samples, split_index, split_str, split_matrix)``: the
  dataset of those elements that must provide ``num_samples`` samples (``None``: one epoch).

A weighted blend asks each prefix for ``ceil(ceil(N * w) * (1 + surplus))`` samples and blends
``sum(ceil(N * w))``; an unweighted one builds one epoch per prefix and blends by their lengths
(capped at N). An empty train split is an error naming ``--split``; an empty valid/test split is
skipped with a warning.

`load_or_build_cached` keeps index arrays as ``.npy`` files (written atomically; under
torch.distributed rank 0 builds while the others wait, then memory-map them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
import warnings
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import numpy as np

from megatrain.atomic_io import atomic_path
from megatrain.data.config import DataConfig

__all__ = [
    "SPLIT_NAMES",
    "build_split_datasets",
    "load_or_build_cached",
    "num_samples_for_splits",
    "open_indexed",
    "parse_blend",
    "parse_split",
    "per_dataset_sizes",
    "split_matrix_from_vector",
    "split_ranges",
]

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")

#: ``make(indexed, prefix, indices, num_samples, split_index, split_str, split_matrix)``
MakeDataset = Callable[..., object]


# ----------------------------------------------------------------------------- flags -> numbers

def parse_split(split: str, flag: str = "--split") -> list[float]:
    """``"969,30,1"`` -> normalised weights ``[0.969, 0.03, 0.001]`` (missing entries are 0).

    Megatron-LM's ``parse_and_normalize_split``: the numbers are the runs of digits and dots, any
    other character only separates them, so ``"'99,1,0'"`` (quotes a bash array passed literally),
    ``"99 1 0"`` and ``"99/1/0"`` all mean 99,1,0."""
    text = str(split)
    numbers = re.findall(r"[.0-9]+", text)
    if len(numbers) > 3:
        raise ValueError(f"{flag} {split!r}: expected up to three non-negative numbers such as '969,30,1', "
                         f"got {len(numbers)}")
    try:
        values = [float(n) for n in numbers]
    except ValueError:
        raise ValueError(f"{flag} {split!r}: {', '.join(numbers)} are not all numbers") from None
    values += [0.0] * (3 - len(values))
    if sum(values) <= 0:
        got = "no number" if not numbers else "all zero"
        raise ValueError(f"{flag} {split!r}: expected up to three non-negative numbers such as '969,30,1', "
                         f"got {got}")
    w = np.asarray(values, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_matrix_from_vector(vector: Sequence[float]) -> list[Optional[tuple[float, float]]]:
    """Normalised split weights -> cumulative bookends per split (``None`` for an empty split)."""
    ends = [0.0]
    for v in vector:
        ends.append(ends[-1] + v)
    return [None if hi <= lo else (lo, hi) for lo, hi in zip(ends[:-1], ends[1:])]


def split_ranges(num_sequences: int, matrix: Sequence[Optional[tuple[float, float]]]):
    """``[beg, end)`` sequence ranges per split (``None`` where the split is empty)."""
    out = []
    for bookend in matrix:
        if bookend is None:
            out.append(None)
        else:
            out.append((int(round(bookend[0] * float(num_sequences))),
                        int(round(bookend[1] * float(num_sequences)))))
    return out


def parse_blend(values: Optional[Sequence[str]], flag: str = "--data-path"):
    """``[W1, P1, W2, P2, ...]`` or ``[P1, P2, ...]`` -> ``(prefixes, weights or None)``.

    As in Megatron: an odd count means prefixes only; an even count is read as weight/prefix
    pairs when every weight parses as a number, and as prefixes only when none does.
    """
    if not values:
        return None
    values = [str(v) for v in values]
    if len(values) % 2 == 1:
        return [v.strip() for v in values], None
    raw_weights, raw_prefixes = values[0::2], values[1::2]
    weights = []
    for w in raw_weights:
        try:
            weights.append(float(w))
        except ValueError:
            weights.append(None)
    if all(w is None for w in weights):
        return [v.strip() for v in values], None
    if any(w is None for w in weights):
        bad = [raw for raw, w in zip(raw_weights, weights) if w is None]
        raise ValueError(f"{flag}: in a weighted blend 'W1 PREFIX1 W2 PREFIX2 ...' every weight must "
                         f"be a number; {', '.join(map(repr, bad))} is not")
    for raw, w in zip(raw_weights, weights):
        if not math.isfinite(w) or w <= 0:
            raise ValueError(f"{flag}: blend weight {raw!r} must be a positive number")
    return [p.strip() for p in raw_prefixes], weights


def num_samples_for_splits(train_iters: Optional[int], train_samples: Optional[int],
                           global_batch_size: int, eval_interval: Optional[int],
                           eval_iters: int) -> tuple[int, int, int]:
    """Samples each split must provide (Megatron's ``get_train_valid_test_num_samples``).

    train = train_samples or train_iters*B; valid = (train_iters//eval_interval + 1) *
    eval_iters * B, where with ``--train-samples`` train_iters = train_samples // B;
    test = eval_iters * B.
    """
    if train_samples:
        train = int(train_samples)
        train_iters = train // global_batch_size
    elif train_iters is not None:
        train = int(train_iters) * global_batch_size
    else:
        raise ValueError("give --train-iters or --train-samples")
    eval_interval = eval_interval or 1000
    valid = (int(train_iters) // eval_interval + 1) * eval_iters * global_batch_size
    test = eval_iters * global_batch_size
    return train, valid, test


# ----------------------------------------------------------------------------- caching

def _dist_rank() -> tuple[bool, int]:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return False, 0
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank()
    return False, 0


def _atomic_write(path: str, write: Callable) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)


def load_or_build_cached(cache_dir: Optional[str], base: str, names: Sequence[str],
                         description: str, build: Callable[[], dict]) -> dict:
    """Arrays ``names`` from ``{cache_dir}/{base}-{name}.npy``, building and saving them on a miss.

    Under torch.distributed rank 0 builds first; every rank passes one barrier; the others then
    memory-map the files (or build for themselves if the files are not visible to them).
    """
    if cache_dir is None:
        return build()
    paths = {n: os.path.join(cache_dir, f"{base}-{n}.npy") for n in names}
    desc_path = os.path.join(cache_dir, f"{base}-description.txt")
    hit = lambda: all(os.path.isfile(p) for p in [desc_path, *paths.values()])  # noqa: E731
    distributed, rank = _dist_rank()
    built = None
    if rank == 0 and not hit():
        t0 = time.time()
        built = build()
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for n, p in paths.items():
                _atomic_write(p, lambda f, a=built[n]: np.save(f, a, allow_pickle=False))
            _atomic_write(desc_path, lambda f: f.write(description.encode("utf-8")))
        except OSError as e:
            raise ValueError(f"cannot write the dataset index cache in {cache_dir} ({e.strerror}); "
                             "give a writable directory with --data-cache-path") from None
        logger.info("built and cached %s in %.3f s", base, time.time() - t0)
    if distributed:
        import torch.distributed as dist

        dist.barrier()
    if built is not None:
        return built
    if not hit():
        return build()
    return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}


# ----------------------------------------------------------------------------- opening

def open_indexed(prefix: str, flag: str):
    """The `IndexedDataset` of ``prefix``; a missing or bad file is a ValueError naming ``flag``."""
    from megatrain.data.indexed_dataset import IndexedDataset

    if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
        hint = ""
        if prefix.endswith((".bin", ".idx")):
            hint = f" (give the prefix without the extension: {prefix[:-4]})"
        raise ValueError(f"{flag}: dataset {prefix!r} not found: expected {prefix}.bin and "
                         f"{prefix}.idx{hint}")
    try:
        return IndexedDataset(prefix)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def per_dataset_sizes(weights: Sequence[float], sizes: Sequence[Optional[int]], surplus: float):
    """Samples per prefix per split: ``ceil(ceil(n * w) * (1 + surplus))`` (None stays None)."""
    return [[int(math.ceil(math.ceil(n * w) * (1 + surplus))) if n is not None else None for n in sizes]
            for w in weights]


# ----------------------------------------------------------------------------- building splits

def _splits_of_prefix(prefix: str, flag: str, matrix, sizes, split_str, make: MakeDataset,
                      numel: Callable[[object], int], open_dataset: Callable[[str, str], object] = open_indexed):
    """The dataset per split (or None) of one prefix."""
    indexed = open_dataset(prefix, flag)
    count = int(numel(indexed))
    ranges = split_ranges(count, matrix)
    out = []
    for i, r in enumerate(ranges):
        if r is None:
            out.append(None)
            continue
        if r[1] <= r[0]:
            if i == 0:
                raise ValueError(f"{flag}: the train split of {prefix} has no documents "
                                 f"(--split {split_str!r} over {count} documents)")
            warnings.warn(f"{prefix}: the {SPLIT_NAMES[i]} split of --split {split_str!r} has no documents "
                          f"({count} documents in all); it is skipped", stacklevel=2)
            out.append(None)
            continue
        indices = np.arange(r[0], r[1], dtype=np.int32)
        out.append(make(indexed, prefix, indices, sizes[i], i, split_str, matrix))
    return out


def _build_blend(cfg: DataConfig, prefixes, weights, flag, matrix, sizes, split_str,
                 make: MakeDataset, numel, open_dataset: Callable[[str, str], object] = open_indexed):
    """Blended dataset per split for several prefixes (Megatron's builder rules)."""
    from megatrain.data.blended_dataset import BlendedDataset, normalize_weights

    if weights is not None:
        weights = normalize_weights(weights)
        targets = per_dataset_sizes(weights, sizes, 0.0)
        buffers = per_dataset_sizes(weights, sizes, cfg.mid_level_dataset_surplus)
    else:
        buffers = [[None] * 3 for _ in prefixes]
    per_prefix = [_splits_of_prefix(p, flag, matrix, buffers[k], split_str, make, numel, open_dataset)
                  for k, p in enumerate(prefixes)]
    out = []
    for i in range(3):
        if matrix[i] is None:
            out.append(None)
            continue
        datasets = [per_prefix[k][i] for k in range(len(prefixes))]
        if any(d is None for d in datasets):
            out.append(None)  # a prefix has no documents in this split (warned above)
            continue
        if weights is not None:
            w_i = weights
            size_i = sum(targets[k][i] for k in range(len(prefixes)))
        else:
            w_i = [len(d) for d in datasets]
            size_i = min(sizes[i], sum(w_i)) if sizes[i] is not None else sum(w_i)
        out.append(BlendedDataset(datasets, w_i, size_i, cfg.data_cache_path, SPLIT_NAMES[i]))
    return out


def build_split_datasets(cfg: DataConfig, num_samples: Sequence[Optional[int]], make: MakeDataset,
                         numel: Callable[[object], int] = len,
                         open_dataset: Callable[[str, str], object] = open_indexed):
    """``(train, valid, test)`` (each may be None) from the data flags of ``cfg``.

    ``num_samples``: the samples each split must provide. ``make`` builds one family's dataset
    of a prefix's split, ``numel`` counts what ``--split`` divides (see the module docstring).
    ``open_dataset(path, flag)`` opens what a path names (default: the ``.bin/.idx`` prefix;
    ``--sft``: a jsonl file). ``--mock-data`` is the caller's business.
    """
    sizes = list(num_samples)
    if cfg.data_path:
        if cfg.has_per_split_paths:
            raise ValueError("give either --data-path or --train/valid/test-data-path, not both")
        prefixes, weights = parse_blend(cfg.data_path, "--data-path")
        matrix = split_matrix_from_vector(parse_split(cfg.split))
        if len(prefixes) == 1 and weights is None:
            return tuple(_splits_of_prefix(prefixes[0], "--data-path", matrix, sizes, cfg.split,
                                           make, numel, open_dataset))
        return tuple(_build_blend(cfg, prefixes, weights, "--data-path", matrix, sizes, cfg.split,
                                  make, numel, open_dataset))
    if cfg.has_per_split_paths:
        out = []
        for i, (flag, values) in enumerate((("--train-data-path", cfg.train_data_path),
                                            ("--valid-data-path", cfg.valid_data_path),
                                            ("--test-data-path", cfg.test_data_path))):
            blend = parse_blend(values, flag)
            if blend is None:
                out.append(None)
                continue
            prefixes, weights = blend
            matrix = [None, None, None]
            matrix[i] = (0.0, 1.0)
            spoof = [0, 0, 0]
            spoof[i] = sizes[i]
            if len(prefixes) == 1:
                out.append(_splits_of_prefix(prefixes[0], flag, matrix, spoof, None, make, numel,
                                             open_dataset)[i])
            else:
                out.append(_build_blend(cfg, prefixes, weights, flag, matrix, spoof, None, make,
                                        numel, open_dataset)[i])
        return tuple(out)
    raise ValueError("no data: give --data-path, --train-data-path/--valid-data-path/--test-data-path "
                     "or --mock-data")


def base_identifiers(cls_name: str, dataset_path: Optional[str], num_samples: Optional[int], split_name: str,
                     seed: int, seq_length: int, split: Optional[str], split_matrix) -> "OrderedDict[str, object]":
    """The first keys of a dataset's description (Megatron's ``unique_identifiers``): its class, path,
    sample count, split and the config attributes every Megatron dataset has."""
    ids: OrderedDict[str, object] = OrderedDict()
    ids["class"] = cls_name
    ids["dataset_path"] = dataset_path
    ids["num_samples"] = num_samples
    ids["index_split"] = split_name
    ids["random_seed"] = seed
    ids["sequence_length"] = seq_length
    ids["split"] = split
    ids["split_matrix"] = split_matrix
    return ids


def add_source_identifiers(ids: "OrderedDict[str, object]", indices: np.ndarray, sizes: np.ndarray) -> None:
    """The last keys: the range of documents used and the size of the indexed dataset (so a changed
    data file gets a new cache entry)."""
    ids["documents"] = [int(indices[0]), int(indices[-1]) + 1] if len(indices) else [0, 0]
    ids["dataset_sequences"] = int(len(sizes))
    ids["dataset_tokens"] = int(np.sum(sizes, dtype=np.int64))


def describe(ids: "OrderedDict[str, object]") -> tuple[str, str]:
    """A dataset's description (indented JSON of ``ids``) and its md5, which names its cache files."""
    text = json.dumps(ids, indent=4)
    return text, hashlib.md5(text.encode("utf-8")).hexdigest()
