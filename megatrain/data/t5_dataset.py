"""T5 span-corruption pre-training samples in Megatron-LM's exact order (``T5MaskedWordPieceDataset``).

The data is sentence-level as for BERT (``tools/preprocess_data.py --split-sentences``: one
sequence per sentence, a document is a group of sentences), with Megatron's ``pretrain_t5.py``
settings fixed here: spans of up to 10 whole words with lengths from SpanBERT's geometric
distribution (p = 0.2), no permutation. The split, the blends, the cached sample index and the
random state of a sample are BERT's (`megatrain.data.bert_dataset.MaskedWordPieceDataset`):

* the sample index (helpers.cpp's ``build_mapping``) has target lengths of at most
  ``encoder_seq_length - 2`` and needs one sentence per document; it is cached as
  ``{md5}-T5MaskedWordPieceDataset-sample_index.npy`` under ``--data-cache-path``, default
  ``PREFIX/cache/T5MaskedWordPieceDataset_indices`` as in Megatron;
* sample ``idx`` draws from ``RandomState((seed + idx) % 2**32)``: the row's sentences are joined
  and cut to the target length (``truncated``), masked (`megatrain.data.masked_lm.mask_tokens`),
  and every masked span is replaced by the next sentinel (the tokenizer's
  ``additional_special_tokens_ids`` in order: ``<extra_id_0>``, ``<extra_id_1>``, ...). The encoder
  input is the text with the sentinels, the decoder input ``[bos] s0 span0 s1 span1 ...``, the
  labels ``s0 span0 s1 span1 ... [eos]`` (one position ahead of the decoder input).

A sample is a dict with Megatron's names, int64 arrays and an int: ``text_enc``
``[encoder_seq_length]``, ``text_dec``, ``labels``, ``loss_mask``, ``dec_mask``
``[decoder_seq_length]``, ``enc_mask`` ``[encoder_seq_length]`` and ``truncated``. Pads are the pad
id, then written as 0 in ``text_enc``/``text_dec`` (and in ``labels`` where they equal the pad id);
``labels`` is -1 after the ``[eos]``; ``loss_mask`` is 1 on the decoder's tokens. ``enc_mask`` and
``dec_mask`` are current Megatron's 1-D padding masks (1 on tokens, 0 on pads), not ``[s, s]``
arrays: Megatron's ``pretrain_t5.py`` turns them into attention masks in ``get_batch``
(``mask < 0.5`` is a pad) and makes the decoder causal there.

`build_t5_datasets` is the trainer's entry point; `check_t5_tokenizer` tells whether a tokenizer
can give T5 samples.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional, Sequence

import numpy as np

from megatrain.data.bert_dataset import (
    BERT_TOKENIZER_TYPES,
    MaskedWordPieceDataset,
    build_masked_datasets,
    check_bert_tokenizer,
    check_masking_flags,
)
from megatrain.data.config import DataConfig
from megatrain.data.dataset_builder import SPLIT_NAMES
from megatrain.data.masked_lm import WordPieceTables, mask_tokens

__all__ = ["T5_MASKING_MAX_NGRAM", "T5MaskedWordPieceDataset", "T5_FIELDS", "build_t5_datasets",
           "check_t5_tokenizer", "t5_sample"]

#: Megatron's ``pretrain_t5.py``: ``masking_max_ngram=10`` with the geometric distribution.
T5_MASKING_MAX_NGRAM = 10
#: The fields of a sample, in the order Megatron's ``__getitem__`` returns them.
T5_FIELDS = ("text_enc", "text_dec", "labels", "loss_mask", "truncated", "enc_mask", "dec_mask")
_CACHE_FOLDER = "T5MaskedWordPieceDataset_indices"


def check_t5_tokenizer(tokenizer) -> None:
    """ValueError unless the tokenizer has what T5 samples need: BERT's [CLS]/[SEP]/[MASK]/[PAD]
    and vocabulary, bos and eos, and sentinels (``additional_special_tokens_ids``)."""
    name = getattr(tokenizer, "name", "") or type(tokenizer).__name__
    try:
        check_bert_tokenizer(tokenizer)
    except ValueError:
        raise ValueError(f"--tokenizer-type {name} has no [CLS]/[SEP]/[MASK]/[PAD] tokens; T5's span "
                         f"corruption needs {' or '.join(BERT_TOKENIZER_TYPES)} with --vocab-extra-ids "
                         "(as Megatron-LM's T5)") from None
    if getattr(tokenizer, "bos", None) is None or getattr(tokenizer, "eos", None) is None:
        raise ValueError(f"--tokenizer-type {name} has no bos/eos token for the T5 decoder")
    if not list(getattr(tokenizer, "additional_special_tokens_ids", None) or []):
        raise ValueError(f"--tokenizer-type {name} has no sentinel tokens: T5's span corruption needs "
                         "--vocab-extra-ids N (Megatron-LM's T5 scripts give --vocab-extra-ids 100)")


def t5_sample(sentences: Sequence[np.ndarray], target_length: int, encoder_seq_length: int,
              decoder_seq_length: int, rng: np.random.RandomState, tables: WordPieceTables,
              sentinels: Sequence[int], bos: int, eos: int, mask_prob: float, where: str = "a sample") -> dict:
    """The sample dict (see the module docstring) of the sentences of one sample-index row.
    ``where`` names the sample in the errors (more spans than sentinels, a decoder too short)."""
    tokens = np.concatenate(sentences).astype(np.int64) if len(sentences) else np.zeros(0, np.int64)
    truncated = tokens.shape[0] > target_length
    tokens = tokens[:target_length]
    masked = mask_tokens(tokens, target_length, mask_prob, tables, rng,
                         max_ngram=T5_MASKING_MAX_NGRAM, geometric=True, replace="mask")
    spans = masked.spans
    if len(spans) > len(sentinels):
        raise ValueError(f"{where} masks {len(spans)} spans but the tokenizer has {len(sentinels)} "
                         "sentinels: raise --vocab-extra-ids")
    decoder_len = 1 + len(spans) + sum(len(span) for span in spans)
    if decoder_len > decoder_seq_length:
        raise ValueError(f"{where} needs {decoder_len} decoder positions ([bos], {len(spans)} sentinels and "
                         f"{decoder_len - 1 - len(spans)} masked tokens) but --decoder-seq-length is "
                         f"{decoder_seq_length} (Megatron asserts here): raise --decoder-seq-length")
    encoder, decoder = [], [np.array([bos], np.int64)]
    begin = 0
    for sentinel, span in zip(sentinels, spans):
        mark = np.array([sentinel], np.int64)
        encoder += [masked.tokens[begin:span[0]], mark]
        decoder += [mark, tokens[span]]
        begin = span[-1] + 1
    encoder.append(masked.tokens[begin:])
    encoder_input, decoder_input = np.concatenate(encoder), np.concatenate(decoder)
    decoder_output = np.append(decoder_input[1:], eos)
    n_enc, n_dec = encoder_input.shape[0], decoder_input.shape[0]
    if n_enc > encoder_seq_length:  # pragma: no cover - the index never targets more than enc - 2
        raise AssertionError(f"{where}: {n_enc} encoder tokens for --encoder-seq-length {encoder_seq_length}")

    pad = tables.pad
    text_enc = np.full(encoder_seq_length, pad, dtype=np.int64)
    text_enc[:n_enc] = encoder_input
    text_dec = np.full(decoder_seq_length, pad, dtype=np.int64)
    text_dec[:n_dec] = decoder_input
    enc_mask = (text_enc != pad).astype(np.int64)
    dec_mask = (text_dec != pad).astype(np.int64)
    labels = np.full(decoder_seq_length, -1, dtype=np.int64)
    labels[:n_dec] = decoder_output
    loss_mask = np.zeros(decoder_seq_length, dtype=np.int64)
    loss_mask[:n_dec] = 1
    text_enc[text_enc == pad] = 0
    text_dec[text_dec == pad] = 0
    labels[labels == pad] = 0
    return {"text_enc": text_enc, "text_dec": text_dec, "labels": labels, "loss_mask": loss_mask,
            "truncated": int(truncated), "enc_mask": enc_mask, "dec_mask": dec_mask}


class T5MaskedWordPieceDataset(MaskedWordPieceDataset):
    """Megatron's T5 samples from the documents ``indices`` of one indexed dataset; ``self[i]`` is
    the dict described in the module docstring. ``seq_length`` is the encoder's."""

    def __init__(self, indexed_dataset, dataset_path: Optional[str], indices: np.ndarray,
                 num_samples: Optional[int], split_name: str, *, tokenizer, encoder_seq_length: int,
                 decoder_seq_length: int, seed: int, mask_prob: float, short_seq_prob: float,
                 cache_dir: Optional[str], split: Optional[str] = None, split_matrix=None):
        self.decoder_seq_length = int(decoder_seq_length)
        self.sentinels = [int(i) for i in tokenizer.additional_special_tokens_ids]
        self.bos, self.eos = int(tokenizer.bos), int(tokenizer.eos)
        masking = {"max_ngram": T5_MASKING_MAX_NGRAM, "do_full_word": True, "do_permutation": False,
                   "use_longer_ngrams": False, "use_geometric_distribution": True}
        # The target leaves room for one [bos] and one [eos] (Megatron's comment; the encoder holds
        # neither, so its last two positions are always pads).
        super().__init__(indexed_dataset, dataset_path, indices, num_samples, split_name,
                         tokenizer=tokenizer, seq_length=encoder_seq_length, seed=seed,
                         mask_prob=mask_prob, short_seq_prob=short_seq_prob, cache_dir=cache_dir,
                         split=split, split_matrix=split_matrix,
                         target_length=int(encoder_seq_length) - 2, min_sentences=1, masking=masking,
                         extra={"sequence_length_decoder": self.decoder_seq_length})

    @property
    def encoder_seq_length(self) -> int:
        return self.seq_length

    def __getitem__(self, idx: int) -> dict:
        idx, beg, end, target, rng = self._row(idx)
        return t5_sample(self.dataset[beg:end], target, self.seq_length, self.decoder_seq_length, rng,
                         self.tables, self.sentinels, self.bos, self.eos, self.mask_prob,
                         where=f"sample {idx} of {self.dataset_path} ({self.split_name})")


def _check_flags(encoder_seq_length: int, decoder_seq_length: Optional[int], seed: int, mask_prob: float,
                 short_seq_prob: float) -> None:
    check_masking_flags(seed, mask_prob, short_seq_prob)
    if encoder_seq_length is None or encoder_seq_length < 4:
        raise ValueError(f"--encoder-seq-length {encoder_seq_length} is too short for T5 samples: "
                         "the sample index targets --encoder-seq-length - 2 tokens, at least 2")
    if decoder_seq_length is None or decoder_seq_length < 1:
        raise ValueError(f"--decoder-seq-length {decoder_seq_length}: T5 samples need a decoder length "
                         "of at least 1 (the [bos])")


def _document_level(indexed) -> bool:
    counts = np.diff(np.asarray(indexed.document_indices, dtype=np.int64))
    return bool(counts.size) and int(counts.max()) <= 1


def build_t5_datasets(config: DataConfig, tokenizer, encoder_seq_length: int, decoder_seq_length: int,
                      seed: int, num_samples: Sequence[Optional[int]], *, mask_prob: float,
                      short_seq_prob: float):
    """``(train, valid, test)`` T5 datasets (each may be None) for the data flags in ``config``.

    ``num_samples`` is the samples each split must provide (``num_samples_for_splits``). Sources
    as for BERT (one prefix, a blend, several prefixes, per-split paths), split by documents.
    Document-level data (every document one sequence) is accepted, as Megatron does (its T5
    example trains on ``_text_document`` files): each sample is then one document cut to the
    target length; a warning says so.
    """
    check_t5_tokenizer(tokenizer)
    _check_flags(encoder_seq_length, decoder_seq_length, seed, mask_prob, short_seq_prob)
    warned: set = set()

    def make(indexed, prefix, indices, samples, split_index, split_str, matrix):
        if prefix not in warned and _document_level(indexed):
            warned.add(prefix)
            warnings.warn(f"{prefix} is document-level (every document is one sequence): each T5 sample is "
                          f"one document cut to --encoder-seq-length - 2 tokens, as in Megatron-LM; "
                          "preprocess with --split-sentences for samples of whole sentences", stacklevel=3)
        cache_dir = config.data_cache_path or os.path.join(prefix, "cache", _CACHE_FOLDER)
        return T5MaskedWordPieceDataset(
            indexed, prefix, indices, samples, SPLIT_NAMES[split_index], tokenizer=tokenizer,
            encoder_seq_length=encoder_seq_length, decoder_seq_length=decoder_seq_length, seed=seed,
            mask_prob=mask_prob, short_seq_prob=short_seq_prob, cache_dir=cache_dir, split=split_str,
            split_matrix=matrix)

    return build_masked_datasets(config, num_samples, make, "T5")
