"""GPT pre-training samples in Megatron-LM's exact order: split, epochs, indices, caching.

For a dataset prefix, a split and a number of samples, three index arrays decide which tokens
form sample ``i`` (the same arrays Megatron-LM builds, bit for bit):

* ``document_index`` (int32): the split's document ids repeated once per epoch, shuffled with
  ``numpy.random.RandomState(seed)``; when the last epoch contributes fewer than 80% of an
  epoch's samples it is shuffled on its own after the others ("separate final epoch").
* ``sample_index`` ([N+1, 2]): for every sample start, the position in ``document_index`` and
  the token offset in that document. Sample ``i`` covers the ``seq_length + 1`` tokens starting
  at global token ``i * seq_length`` of the concatenated documents (consecutive samples share one
  token). Built here in closed form: cumulative lengths + ``searchsorted``, which gives the
  same (position, offset) pairs as Megatron's sequential ``build_sample_idx``, including
  zero-length documents (never chosen as a start) and samples ending exactly at a document end
  (the next sample starts at that document's last token).
* ``shuffle_index``: a permutation of the samples from the same random state (the final epoch's
  samples permuted separately when it is separate).

Indices are cached as ``{md5}-GPTDataset-{split}-{document,sample,shuffle}_index.npy`` (plus a
``description.txt``) under ``--data-cache-path``, default ``PREFIX/cache/GPTDataset_indices``
as in Megatron. Files are written atomically; in a torch.distributed job rank 0 builds while
the other ranks wait at a barrier and then memory-map the files.

The split and blend rules, the flag parsing and the cache are shared with the other dataset
families in `megatrain.data.dataset_builder` (re-exported here); ``--split`` divides GPT data by
sequences.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import numpy as np

from megatrain.data.config import DataConfig
from megatrain.data.dataset_builder import (
    SPLIT_NAMES,
    add_source_identifiers,
    base_identifiers,
    describe,
    build_split_datasets,
    load_or_build_cached,
    num_samples_for_splits,
    parse_blend,
    parse_split,
    split_matrix_from_vector,
    split_ranges,
)

__all__ = [
    "SPLIT_NAMES",
    "GPTDataset",
    "MockGPTDataset",
    "MockLowLevelDataset",
    "build_document_index",
    "build_indices",
    "build_sample_index",
    "build_shuffle_index",
    "build_train_valid_test_datasets",
    "load_or_build_cached",
    "num_epochs_for",
    "num_samples_for_splits",
    "parse_blend",
    "parse_split",
    "split_matrix_from_vector",
    "split_ranges",
]

logger = logging.getLogger(__name__)

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


# ----------------------------------------------------------------------------- index building

def num_epochs_for(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int) -> int:
    """Smallest e >= 1 with e * tokens_per_epoch >= num_samples * seq_length + 1."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """Documents tiled ``num_epochs`` times (int32), shuffled (last epoch alone if separate)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int64), num_epochs).astype(np.int32)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """[N+1, 2] (position in document_index, token offset) of every sample start, N = (T-1)//seq_length.

    Closed form of Megatron's ``build_sample_idx`` (drop-last, one extra token per sample):
    sample i > 0 starts at global token ``i*seq_length``, in the one document whose token
    range contains it (never a zero-length one); sample 0 starts at (0, 0).
    """
    if seq_length <= 1:
        raise ValueError(f"--seq-length must be greater than 1, got {seq_length}")
    lengths = np.asarray(sizes)[document_index].astype(np.int64)
    starts = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    total = int(starts[-1])
    num_samples = (total - 1) // seq_length
    big = max(document_index.shape[0], int(np.max(sizes)) if len(sizes) else 0)
    dtype = np.int32 if big <= np.iinfo(np.int32).max else np.int64
    sample_index = np.zeros((num_samples + 1, 2), dtype=dtype)
    if num_samples:
        positions = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
        doc = np.searchsorted(starts, positions, side="right") - 1
        sample_index[1:, 0] = doc
        sample_index[1:, 1] = positions - starts[doc]
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of [0, num_samples) then (separately) of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_indices(sizes: np.ndarray, documents: np.ndarray, num_samples: Optional[int],
                  seq_length: int, seed: int) -> dict:
    """All three indices for the documents ``documents`` of a dataset with lengths ``sizes``."""
    sizes = np.asarray(sizes)
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    if tokens_per_epoch <= 1:
        raise ValueError(f"the split has {len(documents)} documents with {tokens_per_epoch} tokens; "
                         "at least 2 tokens are needed to form a sample")
    num_epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length)
    separate_final_epoch = False
    if num_epochs > 1:
        samples_sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        samples_from_final = num_samples - samples_sans_final
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        assert 0 <= samples_from_final <= samples_per_epoch + 1
        separate_final_epoch = samples_from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
    sample_index = build_sample_index(sizes, document_index, seq_length)
    total = sample_index.shape[0] - 1
    if separate_final_epoch:
        shuffle_index = build_shuffle_index(samples_sans_final, total, rng)
    else:
        shuffle_index = build_shuffle_index(total, total, rng)
    return {"document_index": document_index, "sample_index": sample_index,
            "shuffle_index": shuffle_index, "num_epochs": num_epochs,
            "separate_final_epoch": separate_final_epoch, "tokens_per_epoch": tokens_per_epoch}


# ----------------------------------------------------------------------------- datasets

class GPTDataset:
    """Fixed-length samples of ``seq_length + 1`` token ids from one indexed dataset.

    ``documents`` are the sequence ids this split may use; ``num_samples`` how many samples
    it must provide (``None``: one epoch). ``dataset[i]`` is an int64 numpy array.
    """

    def __init__(self, indexed_dataset, dataset_path: Optional[str], documents: np.ndarray,
                 num_samples: Optional[int], split_name: str, seq_length: int, seed: int,
                 cache_dir: Optional[str], split: Optional[str] = None,
                 split_matrix=None):
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.documents = np.asarray(documents, dtype=np.int32)
        self.num_samples = num_samples
        self.split_name = split_name
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        sizes = indexed_dataset.sequence_lengths
        ids = base_identifiers(type(self).__name__, dataset_path, num_samples, split_name, self.seed,
                               self.seq_length, split, split_matrix)
        ids["add_extra_token_to_sequence"] = True
        add_source_identifiers(ids, self.documents, sizes)
        self.unique_identifiers = ids
        self.unique_description, self.unique_description_hash = describe(ids)
        if len(self.documents) == 0:
            raise ValueError(f"{dataset_path}: the {split_name} split has no documents; "
                             "adjust --split or add data")

        def build():
            try:
                arrays = build_indices(sizes, self.documents, num_samples, self.seq_length, self.seed)
            except ValueError as e:
                raise ValueError(f"{dataset_path} ({split_name} split): {e}") from None
            logger.info("%s %s: %d samples, %d epochs", dataset_path, split_name,
                        arrays["sample_index"].shape[0] - 1, arrays["num_epochs"])
            return arrays

        arrays = load_or_build_cached(
            cache_dir, f"{self.unique_description_hash}-{type(self).__name__}-{split_name}",
            ("document_index", "sample_index", "shuffle_index"), self.unique_description, build)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        if num_samples is not None and len(self) < num_samples:  # pragma: no cover - invariant
            raise RuntimeError(f"{dataset_path}: built {len(self)} samples, {num_samples} needed")

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int) -> np.ndarray:
        n = len(self)
        if not 0 <= idx < n:
            if -n <= idx < 0:
                idx += n
            else:
                raise IndexError(f"sample {idx} out of range for {n} samples")
        i = int(self.shuffle_index[idx])
        beg, beg_off = (int(x) for x in self.sample_index[i])
        end, end_off = (int(x) for x in self.sample_index[i + 1])
        get = self.dataset.get
        docs = self.document_index
        if beg == end:
            tokens = np.asarray(get(int(docs[beg]), beg_off, end_off - beg_off + 1), dtype=np.int64)
        else:
            parts = [get(int(docs[beg]), beg_off)]
            parts += [get(int(docs[j])) for j in range(beg + 1, end)]
            parts.append(get(int(docs[end]), 0, end_off + 1))
            tokens = np.concatenate(parts).astype(np.int64, copy=False)
        assert tokens.shape[0] == self.seq_length + 1, (tokens.shape, idx)
        return tokens


class MockLowLevelDataset:
    """Megatron's synthetic dataset: 100000 sequences with lengths from ``default_rng(0)``.

    Sequence ``k`` is ``1, 2, ..., L-1, eod``; ids are wrapped into ``[1, vocab_size)`` when the
    vocabulary is smaller than the longest sequence (Megatron does not wrap).
    """

    seed = 0
    size = 100000
    max_sequence_length = 4096

    def __init__(self, eod: int, vocab_size: Optional[int] = None):
        self.eod = int(eod)
        self.vocab_size = vocab_size
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size,
                                             dtype=np.int32)
        self.prefix = None

    def __len__(self) -> int:
        return self.size

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        n = int(self.sequence_lengths[idx])
        if length is None:
            length = n - offset
        ids = np.arange(1, n, dtype=np.int64)
        if self.vocab_size is not None and self.vocab_size > 2 and n > self.vocab_size:
            ids = (ids - 1) % (self.vocab_size - 1) + 1
        seq = np.concatenate([ids, [self.eod]])
        return seq[offset:offset + length]


class MockGPTDataset(GPTDataset):
    """`GPTDataset` over `MockLowLevelDataset` (``--mock-data``); never cached."""


# ----------------------------------------------------------------------------- building splits

def _default_cache_dir(cfg: DataConfig, prefix: str) -> str:
    if cfg.data_cache_path:
        return cfg.data_cache_path
    return os.path.join(prefix, "cache", "GPTDataset_indices")


def build_train_valid_test_datasets(cfg: DataConfig, seq_length: int, seed: int,
                                    num_samples: Sequence[Optional[int]],
                                    tokenizer_vocab_size: Optional[int] = None,
                                    eod: Optional[int] = None):
    """``(train, valid, test)`` datasets (each may be None) for the data flags in ``cfg``.

    ``num_samples`` is the samples each split must provide (`num_samples_for_splits`).
    Sources: ``--mock-data``; ``--data-path`` (one prefix, ``W1 P1 W2 P2 ...``, or several
    prefixes weighted by their sizes) split by ``--split`` over sequences; or
    ``--train/valid/test-data-path`` (`megatrain.data.dataset_builder.build_split_datasets`).
    """
    sizes = list(num_samples)
    if cfg.mock_data:
        if eod is None:
            raise ValueError("--mock-data needs the tokenizer's end-of-document id")
        low = MockLowLevelDataset(eod, tokenizer_vocab_size)
        matrix = split_matrix_from_vector(parse_split("1,1,1"))
        out = []
        for i, r in enumerate(split_ranges(len(low), matrix)):
            docs = np.arange(r[0], r[1], dtype=np.int32)
            out.append(MockGPTDataset(low, None, docs, sizes[i], SPLIT_NAMES[i], seq_length, seed,
                                      None, "1,1,1", matrix))
        return tuple(out)

    def make(indexed, prefix, indices, samples, split_index, split_str, matrix):
        return GPTDataset(indexed, prefix, indices, samples, SPLIT_NAMES[split_index], seq_length,
                          seed, _default_cache_dir(cfg, prefix), split_str, matrix)

    return build_split_datasets(cfg, sizes, make, numel=len)
