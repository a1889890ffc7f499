"""BERT masked-LM pre-training samples in Megatron-LM's exact order (``BERTMaskedWordPieceDataset``).

The data is sentence-level: ``tools/preprocess_data.py --split-sentences`` writes one sequence per
sentence, and a document is a group of sentences. Megatron's ``pretrain_bert.py`` settings are
fixed here: n-grams of up to 3 whole words, no permutation, no longer-n-gram preference, no
geometric distribution; ``classification_head`` is ``--bert-no-binary-head``'s opposite.

* The split: ``--split`` divides a prefix by DOCUMENTS (GPT divides by sequences); samples per
  split, blends and per-split paths follow the shared rules of `megatrain.data.dataset_builder`.
* The sample index (`megatrain.data.bert_mapping.build_mapping`, helpers.cpp's): rows (first
  sentence, end sentence, target length) over as many whole epochs as the requested samples
  need, target lengths at most ``seq_length - 3``, shuffled. With the binary head a document
  needs at least 2 sentences, without it 1. It is cached as
  ``{md5}-BERTMaskedWordPieceDataset-sample_index.npy`` (plus ``-description.txt``) under
  ``--data-cache-path``, default ``PREFIX/cache/BERTMaskedWordPieceDataset_indices`` as in
  Megatron.
* Sample ``idx`` (`megatrain.data.masked_lm.bert_sample`): the random state
  ``RandomState((seed + idx) % 2**32)`` splits, truncates and masks the row's sentences; a dict of
  ``text``, ``types``, ``labels``, ``padding_mask``, ``loss_mask`` (int64 ``[seq_length]``) and
  ``is_random``, ``truncated`` (ints), the names Megatron gives them.

`build_bert_datasets` is the trainer's entry point. `MaskedWordPieceDataset` (Megatron's
``MaskedWordPieceDataset``: the documents of a split, the description, the cached sample index for
a target length and a minimum of sentences) and `build_masked_datasets` (the shared checks and the
split/blend rules over documents) are the parts T5's samples (`megatrain.data.t5_dataset`) share.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import numpy as np

from megatrain.data.bert_mapping import LONG_SENTENCE_LEN, NoSamplesError, build_mapping
from megatrain.data.config import DataConfig
from megatrain.data.dataset_builder import (
    SPLIT_NAMES,
    add_source_identifiers,
    base_identifiers,
    describe,
    build_split_datasets,
    load_or_build_cached,
)
from megatrain.data.masked_lm import MASKING_MAX_NGRAM, bert_sample, wordpiece_tables

__all__ = ["BERT_TOKENIZER_TYPES", "BERTMaskedWordPieceDataset", "MaskedWordPieceDataset",
           "build_bert_datasets", "build_masked_datasets", "check_bert_tokenizer", "check_masking_flags",
           "check_sentence_level", "num_documents"]

logger = logging.getLogger(__name__)

#: The ``--tokenizer-type`` values BERT data is made for.
BERT_TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase")
_CACHE_FOLDER = "BERTMaskedWordPieceDataset_indices"


def num_documents(indexed) -> int:
    """What ``--split`` divides for BERT (Megatron's ``numel_low_level_dataset``): documents."""
    return int(indexed.document_indices.shape[0]) - 1


def check_bert_tokenizer(tokenizer) -> None:
    """ValueError unless the tokenizer has the ids and vocabulary masked-LM samples need."""
    name = getattr(tokenizer, "name", "") or type(tokenizer).__name__
    ids = [getattr(tokenizer, attr, None) for attr in ("cls", "sep", "mask", "pad")]
    if any(i is None for i in ids) or getattr(tokenizer, "inv_vocab", None) is None:
        raise ValueError(f"--tokenizer-type {name} has no [CLS]/[SEP]/[MASK]/[PAD] tokens; BERT needs "
                         f"{' or '.join(BERT_TOKENIZER_TYPES)}")


def check_sentence_level(indexed, prefix: str, binary_head: bool) -> None:
    """A document-level dataset (every document a single sequence) cannot give sentence pairs."""
    counts = np.diff(np.asarray(indexed.document_indices, dtype=np.int64))
    if binary_head and counts.size and int(counts.max()) <= 1:
        raise ValueError(f"{prefix} has no document with at least 2 sentences (every document is a "
                         "single sequence): was it preprocessed with --split-sentences? BERT's "
                         "sentence-pair samples need sentence-level data (tools/preprocess_data.py "
                         "--split-sentences), or train with --bert-no-binary-head")


def _why_no_samples(indexed, prefix: str, split_name: str, indices: np.ndarray,
                    min_sentences: int) -> str:
    bounds = np.asarray(indexed.document_indices, dtype=np.int64)[int(indices[0]):int(indices[-1]) + 2]
    counts = np.diff(bounds)
    where = f"{prefix} ({split_name} split, {len(indices)} documents)"
    if not np.any(counts >= min_sentences):
        hint = ": was it preprocessed with --split-sentences?" if min_sentences > 1 else ""
        return f"{where} has no document with at least {min_sentences} sentence(s){hint}"
    return (f"{where}: every document with at least {min_sentences} sentences holds a sentence longer "
            f"than {LONG_SENTENCE_LEN} tokens, and Megatron's sample index skips such documents")


class MaskedWordPieceDataset:
    """The samples of the documents ``indices`` of one indexed dataset, as rows of the sample index.

    ``num_samples``: how many samples the split must provide (``None``: one epoch); the index
    holds whole epochs, so ``len(self)`` may be larger. A subclass gives its Megatron class name
    (``type(self).__name__``, which names the cache files), ``target_length`` and
    ``min_sentences`` of the sample index, its masking settings (``masking``, the description's
    ``masking_*`` keys), the description keys of its own (``extra``), and ``__getitem__``.
    """

    def __init__(self, indexed_dataset, dataset_path: Optional[str], indices: np.ndarray,
                 num_samples: Optional[int], split_name: str, *, tokenizer, seq_length: int,
                 seed: int, mask_prob: float, short_seq_prob: float, cache_dir: Optional[str],
                 split: Optional[str], split_matrix, target_length: int, min_sentences: int,
                 masking: dict, extra: dict):
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.indices = np.asarray(indices, dtype=np.int32)
        self.num_samples = num_samples
        self.split_name = split_name
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.mask_prob = float(mask_prob)
        self.short_seq_prob = float(short_seq_prob)
        self.tables = wordpiece_tables(tokenizer)
        sizes = indexed_dataset.sequence_lengths
        ids = base_identifiers(type(self).__name__, dataset_path, num_samples, split_name, self.seed,
                               self.seq_length, split, split_matrix)
        ids["tokenizer"] = {"class": getattr(tokenizer, "name", "") or type(tokenizer).__name__,
                            "vocab_size": int(getattr(tokenizer, "vocab_size", 0) or 0)}
        ids["masking_probability"] = self.mask_prob
        ids["short_sequence_probability"] = self.short_seq_prob
        for key, value in masking.items():
            ids[f"masking_{key}"] = value
        ids.update(extra)
        add_source_identifiers(ids, self.indices, sizes)
        self.unique_identifiers = ids
        self.unique_description, self.unique_description_hash = describe(ids)
        if len(self.indices) == 0:
            raise ValueError(f"{dataset_path}: the {split_name} split has no documents; "
                             "adjust --split or add data")
        name = type(self).__name__

        def build():
            # Megatron appends the bound after the last document: boundaries of the split's documents.
            docs = np.asarray(indexed_dataset.document_indices, dtype=np.int64)[
                np.append(self.indices, self.indices[-1] + 1)]
            try:
                sample_index = build_mapping(docs, sizes, num_samples, target_length,
                                             self.short_seq_prob, self.seed, min_sentences)
            except NoSamplesError:
                raise ValueError(_why_no_samples(indexed_dataset, dataset_path, split_name,
                                                 self.indices, min_sentences)) from None
            logger.info("%s %s: %d %s samples", dataset_path, split_name, sample_index.shape[0], name)
            return {"sample_index": sample_index}

        arrays = load_or_build_cached(cache_dir, f"{self.unique_description_hash}-{name}",
                                      ("sample_index",), self.unique_description, build)
        self.sample_index = arrays["sample_index"]
        if num_samples is not None and len(self) < num_samples:  # pragma: no cover - invariant
            raise RuntimeError(f"{dataset_path}: built {len(self)} samples, {num_samples} needed")

    def __len__(self) -> int:
        return int(self.sample_index.shape[0])

    def _row(self, idx: int) -> tuple[int, int, int, int, np.random.RandomState]:
        """``(idx, first sentence, end sentence, target length, random state)`` of sample ``idx``
        (negative indices count from the end); the random state is the one Megatron's
        ``__getitem__`` makes."""
        n = len(self)
        if not 0 <= idx < n:
            if -n <= idx < 0:
                idx += n
            else:
                raise IndexError(f"sample {idx} out of range for {n} samples")
        beg, end, target = (int(x) for x in self.sample_index[idx])
        return idx, beg, end, target, np.random.RandomState(seed=(self.seed + idx) % 2**32)


class BERTMaskedWordPieceDataset(MaskedWordPieceDataset):
    """Megatron's BERT samples from the documents ``indices`` of one indexed dataset; ``self[i]``
    is the dict described in the module docstring."""

    def __init__(self, indexed_dataset, dataset_path: Optional[str], indices: np.ndarray,
                 num_samples: Optional[int], split_name: str, *, tokenizer, seq_length: int,
                 seed: int, mask_prob: float, short_seq_prob: float, binary_head: bool,
                 cache_dir: Optional[str], split: Optional[str] = None, split_matrix=None):
        self.binary_head = bool(binary_head)
        masking = {"max_ngram": MASKING_MAX_NGRAM, "do_full_word": True, "do_permutation": False,
                   "use_longer_ngrams": False, "use_geometric_distribution": False}
        super().__init__(indexed_dataset, dataset_path, indices, num_samples, split_name,
                         tokenizer=tokenizer, seq_length=seq_length, seed=seed, mask_prob=mask_prob,
                         short_seq_prob=short_seq_prob, cache_dir=cache_dir, split=split,
                         split_matrix=split_matrix, target_length=int(seq_length) - 3,
                         min_sentences=2 if self.binary_head else 1, masking=masking,
                         extra={"classification_head": self.binary_head})

    def __getitem__(self, idx: int) -> dict:
        idx, beg, end, target, rng = self._row(idx)
        return bert_sample(self.dataset[beg:end], target, self.seq_length, rng, self.tables,
                           self.mask_prob, self.binary_head)


def check_masking_flags(seed: int, mask_prob: float, short_seq_prob: float) -> None:
    """The flags every masked word-piece dataset checks (Megatron asserts them)."""
    if not 0.0 < mask_prob < 1.0:
        raise ValueError(f"--mask-prob must be in (0, 1), got {mask_prob}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ValueError(f"--short-seq-prob must be in [0, 1], got {short_seq_prob}")
    if not 0 < seed < 2**31 - 1:
        raise ValueError(f"--seed {seed}: the masked-LM sample index takes a positive 32-bit seed "
                         "(1 to 2147483646, as Megatron's helpers.cpp)")


def _check_flags(seq_length: int, seed: int, mask_prob: float, short_seq_prob: float) -> None:
    check_masking_flags(seed, mask_prob, short_seq_prob)
    if seq_length < 5:
        raise ValueError(f"--seq-length {seq_length} is too short for BERT samples: [CLS], two [SEP] and "
                         "at least 2 tokens need 5")


def build_masked_datasets(cfg: DataConfig, num_samples: Sequence[Optional[int]], make, family: str):
    """``(train, valid, test)`` of ``make(indexed, prefix, indices, samples, split_index, split_str,
    matrix)`` over the data flags in ``cfg``, split by documents; ``--mock-data`` is refused
    (Megatron's mock datasets are GPT's)."""
    if cfg.mock_data:
        raise ValueError(f"--mock-data gives GPT token data only (as in Megatron-LM); {family} needs "
                         "sentence-level data: give --data-path PREFIX made by tools/preprocess_data.py "
                         "--split-sentences")
    return build_split_datasets(cfg, num_samples, make, numel=num_documents)


def build_bert_datasets(cfg: DataConfig, tokenizer, seq_length: int, seed: int,
                        num_samples: Sequence[Optional[int]], *, mask_prob: float,
                        short_seq_prob: float, binary_head: bool):
    """``(train, valid, test)`` BERT datasets (each may be None) for the data flags in ``cfg``.

    ``num_samples`` is the samples each split must provide (``num_samples_for_splits``).
    Sources as for GPT (one prefix, a blend, several prefixes, per-split paths), split by
    documents. ``--mock-data`` is refused: Megatron's mock datasets are GPT's.
    """
    check_bert_tokenizer(tokenizer)
    _check_flags(seq_length, seed, mask_prob, short_seq_prob)

    def make(indexed, prefix, indices, samples, split_index, split_str, matrix):
        check_sentence_level(indexed, prefix, binary_head)
        cache_dir = cfg.data_cache_path or os.path.join(prefix, "cache", _CACHE_FOLDER)
        return BERTMaskedWordPieceDataset(
            indexed, prefix, indices, samples, SPLIT_NAMES[split_index], tokenizer=tokenizer,
            seq_length=seq_length, seed=seed, mask_prob=mask_prob, short_seq_prob=short_seq_prob,
            binary_head=binary_head, cache_dir=cache_dir, split=split_str, split_matrix=matrix)

    return build_masked_datasets(cfg, num_samples, make, "BERT")
