"""BERT masked-LM samples, sample for sample against Megatron-LM's algorithm.

The reference below is a plain transcription of megatron-core's ``helpers.cpp``
(``build_mapping_impl``, ``get_target_sample_len``), ``bert_dataset.py`` (``__getitem__``,
``_get_token_mask``) and ``masked_dataset.py`` (``_create_masked_lm_predictions``) with
``pretrain_bert.py``'s settings, with pure-Python Mersenne Twisters, written without the package's
vectorisation. The package's datasets are compared with it field by field on data made by the real
``tools/preprocess_data.py --split-sentences``.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megatrain.data import bert_dataset as bert_dataset_module
from megatrain.data.bert_dataset import BERTMaskedWordPieceDataset, build_bert_datasets
from megatrain.data.bert_mapping import build_mapping
from megatrain.data.config import DataConfig
from megatrain.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megatrain.data.loader import collate_samples
from megatrain.data.mt19937 import MT19937, MT19937_64
from megatrain.data.tokenizers import BertWordPieceTokenizer, NullTokenizer

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("text", "types", "labels", "is_random", "padding_mask", "loss_mask", "truncated")


# ============================================================================ the reference

class PyMT19937:
    """std::mt19937, straight from the algorithm's definition."""

    def __init__(self, seed):
        self.mt = [0] * 624
        self.mt[0] = seed & 0xFFFFFFFF
        for i in range(1, 624):
            self.mt[i] = (1812433253 * (self.mt[i - 1] ^ (self.mt[i - 1] >> 30)) + i) & 0xFFFFFFFF
        self.index = 624

    def __call__(self):
        if self.index >= 624:
            for i in range(624):
                y = (self.mt[i] & 0x80000000) | (self.mt[(i + 1) % 624] & 0x7FFFFFFF)
                self.mt[i] = self.mt[(i + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            self.index = 0
        y = self.mt[self.index]
        self.index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        y ^= y >> 18
        return y & 0xFFFFFFFF


class PyMT19937_64:
    """std::mt19937_64, straight from the algorithm's definition."""

    def __init__(self, seed):
        mask = (1 << 64) - 1
        self.mt = [0] * 312
        self.mt[0] = seed & mask
        for i in range(1, 312):
            self.mt[i] = (6364136223846793005 * (self.mt[i - 1] ^ (self.mt[i - 1] >> 62)) + i) & mask
        self.index = 312

    def __call__(self):
        if self.index >= 312:
            for i in range(312):
                x = (self.mt[i] & 0xFFFFFFFF80000000) | (self.mt[(i + 1) % 312] & 0x7FFFFFFF)
                xa = x >> 1
                if x & 1:
                    xa ^= 0xB5026F5AA96619E9
                self.mt[i] = self.mt[(i + 156) % 312] ^ xa
            self.index = 0
        x = self.mt[self.index]
        self.index += 1
        x ^= (x >> 29) & 0x5555555555555555
        x ^= (x << 17) & 0x71D67FFFEDA60000
        x ^= (x << 37) & 0xFFF7EEE000000000
        x ^= x >> 43
        return x & ((1 << 64) - 1)


def ref_get_target_sample_len(short_seq_ratio, max_length, rand32_gen):
    if short_seq_ratio == 0:
        return max_length
    random_number = rand32_gen()
    if (random_number % short_seq_ratio) == 0:
        return 2 + random_number % (max_length - 1)
    return max_length


def ref_build_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed,
                      min_num_sent):
    """build_mapping_impl: the second pass only (the first one just counts)."""
    short_seq_ratio = 0
    if short_seq_prob > 0:
        short_seq_ratio = int(math.floor(1.0 / short_seq_prob + 0.5))  # C's round()
    rand32_gen = PyMT19937(seed)
    maps = []
    map_index = 0
    for epoch in range(num_epochs):
        if map_index >= max_num_samples:
            break
        for doc in range(len(docs) - 1):
            sent_index_first = int(docs[doc])
            sent_index_last = int(docs[doc + 1])
            prev_start_index = sent_index_first
            num_remain_sent = sent_index_last - sent_index_first
            contains_long_sentence = False
            if num_remain_sent > 1:
                for sent_index in range(sent_index_first, sent_index_last):
                    if sizes[sent_index] > 512:
                        contains_long_sentence = True
                        break
            if num_remain_sent >= min_num_sent and not contains_long_sentence:
                seq_len = 0
                num_sent = 0
                target_seq_len = ref_get_target_sample_len(short_seq_ratio, max_seq_length, rand32_gen)
                for sent_index in range(sent_index_first, sent_index_last):
                    seq_len += int(sizes[sent_index])
                    num_sent += 1
                    num_remain_sent -= 1
                    if ((seq_len >= target_seq_len and num_remain_sent > 1 and num_sent >= min_num_sent)
                            or num_remain_sent == 0):
                        maps.append([prev_start_index, sent_index + 1, target_seq_len])
                        map_index += 1
                        prev_start_index = sent_index + 1
                        target_seq_len = ref_get_target_sample_len(short_seq_ratio, max_seq_length,
                                                                   rand32_gen)
                        seq_len = 0
                        num_sent = 0
    num_samples = len(maps)
    rand64_gen = PyMT19937_64(seed + 1)
    for i in range(num_samples - 1, 0, -1):
        j = rand64_gen() % (i + 1)
        maps[i], maps[j] = maps[j], maps[i]
    return np.array(maps, dtype=np.int64).reshape(-1, 3)


class RefBERTDataset:
    """BERTMaskedWordPieceDataset.__getitem__ and _create_masked_lm_predictions, transcribed."""

    def __init__(self, dataset, sample_index, tokenizer, sequence_length, random_seed,
                 masking_probability, classification_head):
        self.dataset = dataset
        self.sample_index = sample_index
        self.tokenizer = tokenizer
        self.sequence_length = sequence_length
        self.random_seed = random_seed
        self.masking_probability = masking_probability
        self.masking_max_ngram = 3
        self.masking_do_full_word = True
        self.classification_head = classification_head
        self.token_lookup = sorted(tokenizer.inv_vocab.keys())
        try:
            self._pad_token_id = tokenizer.pad
        except Exception:
            self._pad_token_id = -1
        special_tokens = []
        for name in ("eos", "eod"):
            try:
                special_tokens.append(getattr(tokenizer, name))
            except (AttributeError, NotImplementedError):
                pass
        if self._pad_token_id in special_tokens:
            self._pad_token_id = -1

    def __len__(self):
        return self.sample_index.shape[0]

    def __getitem__(self, idx):
        idx_beg, idx_end, target_sequence_length = (int(x) for x in self.sample_index[idx])
        sample = [self.dataset[i] for i in range(idx_beg, idx_end)]
        numpy_random_state = np.random.RandomState(seed=(self.random_seed + idx) % 2**32)
        assert target_sequence_length <= self.sequence_length
        pivot = len(sample)
        is_next_random = False
        if self.classification_head:
            assert len(sample) > 1, "the sample must contain at least two sentences"
            pivot = 1
            if len(sample) >= 3:
                pivot = numpy_random_state.randint(low=1, high=len(sample))
            is_next_random = numpy_random_state.random() < 0.5
        split_A = []
        for sample_a in sample[:pivot]:
            split_A.extend(sample_a)
        split_B = []
        for sample_b in sample[pivot:]:
            split_B.extend(sample_b)
        if is_next_random:
            split_A, split_B = split_B, split_A
        length_A = len(split_A)
        length_B = len(split_B)
        if length_A + length_B <= target_sequence_length:
            truncated = False
        else:
            while length_A + length_B > target_sequence_length:
                split = split_A if length_A > length_B else split_B
                if numpy_random_state.random() < 0.5:
                    del split[0]
                else:
                    del split[-1]
                length_A = len(split_A)
                length_B = len(split_B)
            truncated = True
        tokens = [self.tokenizer.cls, *split_A, self.tokenizer.sep]
        assignments = [0 for _ in range(1 + len(split_A) + 1)]
        if split_B:
            tokens += [*split_B, self.tokenizer.sep]
            assignments += [1 for _ in range(len(split_B) + 1)]
        tokens, masked_positions, masked_labels = self._create_masked_lm_predictions(
            tokens, target_sequence_length, numpy_random_state)
        length_toks = len(tokens)
        length_pads = self.sequence_length - length_toks
        assert length_pads >= 0
        tokens = np.array(tokens, dtype=np.int64)
        tokens = np.pad(tokens, (0, length_pads), constant_values=self._pad_token_id)
        assignments = np.array(assignments, dtype=np.int64)
        assignments = np.pad(assignments, (0, length_pads), constant_values=self._pad_token_id)
        mask_pads = np.ones(self.sequence_length, dtype=np.int64)
        mask_pads[tokens == self._pad_token_id] = self._pad_token_id
        labels = np.zeros(self.sequence_length, dtype=np.int64) - 1
        labels[masked_positions] = masked_labels
        mask_loss = np.zeros(self.sequence_length, dtype=np.int64)
        mask_loss[masked_positions] = 1
        tokens[tokens == self._pad_token_id] = 0
        labels[labels == self._pad_token_id] = 0
        return {"text": tokens, "types": assignments, "labels": labels, "is_random": int(is_next_random),
                "padding_mask": mask_pads, "loss_mask": mask_loss, "truncated": int(truncated)}

    def _get_token_mask(self, numpy_random_state):
        if numpy_random_state.random() < 0.8:
            return self.tokenizer.mask
        else:
            if numpy_random_state.random() >= 0.5:
                return self.token_lookup[numpy_random_state.randint(0, len(self.token_lookup))]
        return None

    def _create_masked_lm_predictions(self, token_ids, target_sequence_length, numpy_random_state):
        boundaries = []
        candidates = []
        for i, token_id in enumerate(token_ids):
            if token_id == self.tokenizer.cls or token_id == self.tokenizer.sep:
                boundaries.append(1)
            else:
                if not self.tokenizer.inv_vocab[token_id].startswith("##"):
                    boundaries.append(1)
                    candidates.append([i])
                else:
                    boundaries.append(0)
                    if self.masking_do_full_word and len(candidates) > 0:
                        candidates[-1].append(i)
                    else:
                        candidates.append([i])
        n_maskings = min(self.masking_probability * target_sequence_length,
                         max(1, int(round(len(token_ids) * self.masking_probability))))
        ngram_nvals = np.arange(self.masking_max_ngram, dtype=np.int64) + 1
        nprobs = 1.0 / ngram_nvals
        nprobs = nprobs / nprobs.sum(keepdims=True)
        candidate_ngrams = [[candidates[idx:idx + n] for n in ngram_nvals] for idx in range(len(candidates))]
        numpy_random_state.shuffle(candidate_ngrams)
        masked_token_ids = list(token_ids)
        masked_positions_and_labels = []
        masked_indices = set()
        for candidate_idx in range(len(candidate_ngrams)):
            n_ngrams = len(candidate_ngrams[candidate_idx])
            if len(masked_positions_and_labels) >= n_maskings:
                break
            if not candidate_ngrams[candidate_idx]:
                continue
            p = nprobs[:n_ngrams] / nprobs[:n_ngrams].sum(keepdims=True)
            n = numpy_random_state.choice(ngram_nvals[:n_ngrams], p=p)
            while True:
                ngram_indices = sum(candidate_ngrams[candidate_idx][n - 1], [])
                n = n - 1
                if n_maskings >= len(masked_positions_and_labels) + len(ngram_indices):
                    skip_candidate = False
                    break
                if n == 0:
                    skip_candidate = True
                    break
            if skip_candidate:
                continue
            if any(map(lambda idx: idx in masked_indices, ngram_indices)):
                continue
            for index in ngram_indices:
                masked_indices.add(index)
                mask = self._get_token_mask(numpy_random_state)
                if mask is None:
                    masked_token_ids[index] = token_ids[index]
                else:
                    masked_token_ids[index] = mask
                masked_positions_and_labels.append((index, token_ids[index]))
        assert len(masked_positions_and_labels) <= n_maskings
        numpy_random_state.shuffle(candidate_ngrams)
        masked_positions_and_labels = sorted(masked_positions_and_labels, key=lambda x: x[0])
        masked_positions = [position for position, _ in masked_positions_and_labels]
        masked_labels = [label for _, label in masked_positions_and_labels]
        return masked_token_ids, masked_positions, masked_labels


def ref_split(num_elements, split, i):
    """[beg, end) of split i: normalised weights, cumulative bookends, round()."""
    weights = [float(x) for x in split.split(",")]
    weights = [w / sum(weights) for w in weights]
    bookends = [0.0]
    for w in weights:
        bookends.append(bookends[-1] + w)
    return int(round(bookends[i] * float(num_elements))), int(round(bookends[i + 1] * float(num_elements)))


def ref_dataset(prefix, tokenizer, beg, end, num_samples, seq_length, seed, mask_prob, short_seq_prob,
                binary_head):
    """Megatron's BERT dataset over documents [beg, end) of ``prefix``."""
    indexed = IndexedDataset(prefix)
    indices = np.arange(beg, end, dtype=np.int32)
    docs = indexed.document_indices[np.append(indices, indices[-1] + 1)]
    if num_samples is None:  # one epoch
        mapping = ref_build_mapping(docs, indexed.sequence_lengths, 1, 2**64 - 1, seq_length - 3,
                                    short_seq_prob, seed, 2 if binary_head else 1)
    else:
        mapping = ref_build_mapping(docs, indexed.sequence_lengths, 2**31 - 2, num_samples, seq_length - 3,
                                    short_seq_prob, seed, 2 if binary_head else 1)
    return RefBERTDataset(indexed, mapping, tokenizer, seq_length, seed, mask_prob, binary_head)


def ref_blending_indices(weights, size):
    dataset_index, dataset_sample_index = [], []
    current = [0] * len(weights)
    for i in range(size):
        step = max(i, 1)
        errors = [w * step - c for w, c in zip(weights, current)]
        d = errors.index(max(errors))
        dataset_index.append(d)
        dataset_sample_index.append(current[d])
        current[d] += 1
    return dataset_index, dataset_sample_index


# ============================================================================ data

ROOTS = ["play", "work", "jump", "walk", "talk", "read", "paint", "build", "open", "clean", "the", "a",
         "cat", "dog", "house", "river", "tree", "city", "music", "light", "green", "blue", "fast", "slow",
         "happy", "quiet", "over", "under", "with", "and"]
SUFFIXES = ["ing", "ed", "er", "s", "ly", "ness"]


def write_vocab(path):
    tokens = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "!", "?"] + ROOTS
              + ["##" + s for s in SUFFIXES] + ["un", "##believ", "##able"])
    path.write_text("\n".join(tokens) + "\n")
    return str(path)


def write_corpus(path, num_docs, seed, max_sentences=9, max_words=14):
    """Documents of sentences the splitter cuts (". " + capital); words of one to three pieces."""
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(num_docs):
            sentences = []
            for _ in range(rnd.randint(1, max_sentences)):
                words = []
                for _ in range(rnd.randint(1, max_words)):
                    word, x = rnd.choice(ROOTS), rnd.random()
                    if x < 0.3:
                        word += rnd.choice(SUFFIXES)
                    elif x < 0.35:
                        word = "unbelievable"
                    words.append(word)
                sentences.append(" ".join(words).capitalize() + rnd.choice([".", "!", "?"]))
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")
    return str(path)


def preprocess(jsonl, prefix, vocab, *extra):
    cmd = [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", jsonl, "--output-prefix",
           prefix, "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab, "--no-progress", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert_corpus")
    vocab = write_vocab(root / "vocab.txt")
    preprocess(write_corpus(root / "a.jsonl", 300, 0), str(root / "a"), vocab, "--split-sentences")
    preprocess(write_corpus(root / "b.jsonl", 200, 1), str(root / "b"), vocab, "--split-sentences")
    preprocess(write_corpus(root / "d.jsonl", 60, 2), str(root / "d"), vocab)  # document level
    return {"root": root, "vocab": vocab, "tokenizer": BertWordPieceTokenizer(vocab),
            "a": str(root / "a_text_sentence"), "b": str(root / "b_text_sentence"),
            "doc": str(root / "d_text_document")}


def assert_same(got, ref, indices):
    for i in indices:
        want, have = ref[i], got[i]
        assert set(have) == set(FIELDS)
        for key in FIELDS:
            if key in ("is_random", "truncated"):
                assert isinstance(have[key], int) and have[key] == want[key], (i, key)
            else:
                assert have[key].dtype == np.int64 and have[key].shape == want[key].shape, (i, key)
                np.testing.assert_array_equal(have[key], want[key], err_msg=f"sample {i}, field {key}")


# ============================================================================ generators

def test_generators_match_the_standard_reference_values():
    gen32, gen64 = MT19937(), MT19937_64()
    assert int(gen32.take(10000)[-1]) == 4123659995
    assert int(gen64.take(10000)[-1]) == 9981545732273789042
    py32, py64 = PyMT19937(5489), PyMT19937_64(5489)
    assert [py32() for _ in range(10000)][-1] == 4123659995
    assert [py64() for _ in range(10000)][-1] == 9981545732273789042


@pytest.mark.parametrize("seed", [1, 1234, 2**31 - 2, 2**32 - 1])
def test_generators_match_plain_ones_across_blocks(seed):
    # numpy's RandomState(seed) is std::mt19937(seed); blocks of any size continue the stream.
    gen32, py32 = MT19937(seed), PyMT19937(seed)
    got = np.concatenate([gen32.take(k) for k in (1, 623, 2, 700, 30)]).tolist()
    assert got == [py32() for _ in range(len(got))]
    gen64, py64 = MT19937_64(seed + 1), PyMT19937_64(seed + 1)
    got = np.concatenate([gen64.take(k) for k in (1, 311, 2, 400, 3)]).tolist()
    assert got == [py64() for _ in range(len(got))]


# ============================================================================ the sample index

def test_build_mapping_matches_helpers_cpp_on_random_documents():
    rng = np.random.default_rng(0)
    compared = 0
    for _ in range(120):
        num_docs = int(rng.integers(1, 40))
        bounds = np.concatenate([[0], np.cumsum(rng.integers(0, 10, size=num_docs))])
        sizes = rng.integers(0, 50, size=int(bounds[-1])).astype(np.int32)
        if rng.random() < 0.3 and sizes.size:
            sizes[rng.integers(0, sizes.size)] = 600  # a long sentence
        max_len = int(rng.choice([2, 5, 29, 125]))
        prob = float(rng.choice([0.0, 0.05, 0.1, 0.4, 1.0]))  # 0.4: round(2.5) is 3 in C
        seed, min_sent, wanted = int(rng.integers(1, 10000)), int(rng.integers(1, 3)), int(rng.integers(0, 200))
        lo = int(rng.integers(0, num_docs))
        hi = int(rng.integers(lo + 1, num_docs + 1))
        docs = bounds[lo:hi + 1]
        try:
            got = build_mapping(docs, sizes, wanted, max_len, prob, seed, min_sent)
        except ValueError:  # no usable document: Megatron would loop without end
            assert ref_build_mapping(docs, sizes, 1, 1, max_len, prob, seed, min_sent).shape[0] == 0
            continue
        want = ref_build_mapping(docs, sizes, 2**31 - 2, wanted, max_len, prob, seed, min_sent)
        assert got.dtype == np.uint32
        np.testing.assert_array_equal(got.astype(np.int64), want)
        compared += 1
    assert compared > 80


def test_index_for_a_million_sentences_is_quick():
    rng = np.random.default_rng(1)
    bounds = np.concatenate([[0], np.cumsum(rng.integers(1, 33, size=60000))])
    sizes = rng.integers(5, 60, size=int(bounds[-1])).astype(np.int32)
    assert sizes.size > 900_000
    t0 = time.perf_counter()
    mapping = build_mapping(bounds, sizes, 1_000_000, 125, 0.1, 1234, 2)
    elapsed = time.perf_counter() - t0
    assert mapping.shape[0] >= 1_000_000 and mapping.shape[1] == 3
    assert elapsed < 30, f"{elapsed:.1f} s for {sizes.size} sentences"


# ============================================================================ the samples

@pytest.mark.parametrize("binary_head, short_seq_prob, seq_length, seed, mask_prob", [
    (True, 0.1, 128, 1234, 0.15),
    (True, 0.0, 32, 7, 0.15),
    (True, 1.0, 128, 99, 0.15),
    (False, 0.1, 32, 5, 0.15),
    (False, 0.0, 128, 31337, 0.15),
    (False, 1.0, 32, 2, 0.15),
    (True, 0.1, 32, 42, 0.4),
])
def test_samples_match_megatron(corpus, binary_head, short_seq_prob, seq_length, seed, mask_prob):
    tok = corpus["tokenizer"]
    sizes = (200, 40, 8)
    train, valid, test = build_bert_datasets(
        DataConfig(data_path=[corpus["a"]], split="8,1,1", data_cache_path=str(corpus["root"] / "cache")),
        tok, seq_length, seed, sizes, mask_prob=mask_prob, short_seq_prob=short_seq_prob,
        binary_head=binary_head)
    num_docs = IndexedDataset(corpus["a"]).num_documents
    for ds, i, n in ((train, 0, sizes[0]), (valid, 1, sizes[1]), (test, 2, sizes[2])):
        assert isinstance(ds, BERTMaskedWordPieceDataset)
        beg, end = ref_split(num_docs, "8,1,1", i)
        ref = ref_dataset(corpus["a"], tok, beg, end, n, seq_length, seed, mask_prob, short_seq_prob,
                          binary_head)
        np.testing.assert_array_equal(np.asarray(ds.sample_index, dtype=np.int64), ref.sample_index)
        assert len(ds) == len(ref) >= n
        assert_same(ds, ref, range(min(len(ds), n + 20)))
    # The masking met whole words of several pieces and n-grams.
    subword = [tok.inv_vocab[int(t)].startswith("##") for i in range(len(train))
               for t in train[i]["labels"][train[i]["loss_mask"] == 1]]
    assert any(subword)
    assert {train[i]["is_random"] for i in range(50)} == ({0, 1} if binary_head else {0})
    assert any(train[i]["truncated"] for i in range(len(train)))


def test_weighted_blend_matches_megatron(corpus):
    tok = corpus["tokenizer"]
    n, seq, seed = 120, 64, 17
    cfg = DataConfig(data_path=["0.3", corpus["a"], "0.7", corpus["b"]], split="8,1,1",
                     data_cache_path=str(corpus["root"] / "cache"))
    train = build_bert_datasets(cfg, tok, seq, seed, (n, 10, 10), mask_prob=0.15, short_seq_prob=0.1,
                                binary_head=True)[0]
    weights = [0.3, 0.7]
    refs = []
    for prefix, w in zip((corpus["a"], corpus["b"]), weights):
        beg, end = ref_split(IndexedDataset(prefix).num_documents, "8,1,1", 0)
        wanted = int(math.ceil(math.ceil(n * w) * 1.005))
        refs.append(ref_dataset(prefix, tok, beg, end, wanted, seq, seed, 0.15, 0.1, True))
    size = sum(int(math.ceil(n * w)) for w in weights)
    assert len(train) == size
    which, sample = ref_blending_indices(weights, size)
    for i in range(size):
        want, have = refs[which[i]][sample[i]], train[i]
        for key in FIELDS:
            np.testing.assert_array_equal(np.asarray(have[key]), np.asarray(want[key]), err_msg=f"{i} {key}")


def test_unweighted_prefixes_and_per_split_paths(corpus):
    tok = corpus["tokenizer"]
    seq, seed = 32, 3
    # Several prefixes without weights: one epoch each, blended by their lengths.
    train = build_bert_datasets(DataConfig(data_path=[corpus["a"], corpus["b"]], split="8,1,1"), tok, seq,
                                seed, (150, 10, 10), mask_prob=0.15, short_seq_prob=0.1, binary_head=False)[0]
    refs = []
    for prefix in (corpus["a"], corpus["b"]):
        beg, end = ref_split(IndexedDataset(prefix).num_documents, "8,1,1", 0)
        refs.append(ref_dataset(prefix, tok, beg, end, None, seq, seed, 0.15, 0.1, False))
    lengths = [len(r) for r in refs]
    assert len(train) == min(150, sum(lengths))
    weights = [x / sum(lengths) for x in lengths]
    which, sample = ref_blending_indices(weights, len(train))
    for i in range(len(train)):
        want, have = refs[which[i]][sample[i]], train[i]
        for key in FIELDS:
            np.testing.assert_array_equal(np.asarray(have[key]), np.asarray(want[key]))
    # --train-data-path / --valid-data-path: each file whole.
    train, valid, test = build_bert_datasets(
        DataConfig(train_data_path=[corpus["a"]], valid_data_path=[corpus["b"]]), tok, seq, seed,
        (100, 30, 5), mask_prob=0.2, short_seq_prob=0.0, binary_head=True)
    assert test is None
    for ds, prefix, n in ((train, corpus["a"], 100), (valid, corpus["b"], 30)):
        ref = ref_dataset(prefix, tok, 0, IndexedDataset(prefix).num_documents, n, seq, seed, 0.2, 0.0, True)
        assert_same(ds, ref, range(n))


def test_split_is_by_documents(corpus):
    indexed = IndexedDataset(corpus["a"])
    train, valid, _ = build_bert_datasets(DataConfig(data_path=[corpus["a"]], split="90,10,0"),
                                          corpus["tokenizer"], 32, 1, (10, 10, 0), mask_prob=0.15,
                                          short_seq_prob=0.1, binary_head=True)
    cut = round(0.9 * indexed.num_documents)
    assert train.indices[0] == 0 and train.indices[-1] == cut - 1 and valid.indices[0] == cut
    first_valid_sentence = int(indexed.document_indices[cut])
    assert int(np.max(train.sample_index[:, 1])) <= first_valid_sentence
    assert int(np.min(valid.sample_index[:, 0])) >= first_valid_sentence


def test_cache_is_reused(corpus, tmp_path, monkeypatch):
    tok = corpus["tokenizer"]
    cfg = DataConfig(data_path=[corpus["a"]], split="8,1,1", data_cache_path=str(tmp_path / "c"))

    def build():
        return build_bert_datasets(cfg, tok, 64, 11, (50, 10, 2), mask_prob=0.15, short_seq_prob=0.1,
                                   binary_head=True)

    first = build()
    names = sorted(os.listdir(tmp_path / "c"))
    assert len(names) == 6
    assert all(n.endswith(("-BERTMaskedWordPieceDataset-sample_index.npy",
                           "-BERTMaskedWordPieceDataset-description.txt")) for n in names)
    description = json.loads((tmp_path / "c" / [n for n in names if n.endswith(".txt")][0]).read_text())
    assert description["class"] == "BERTMaskedWordPieceDataset" and "classification_head" in description

    def refuse(*args, **kwargs):
        raise AssertionError("the cached index was rebuilt")

    monkeypatch.setattr(bert_dataset_module, "build_mapping", refuse)
    second = build()
    for a, b in zip(first, second):
        assert isinstance(b.sample_index, np.memmap)
        np.testing.assert_array_equal(a.sample_index, b.sample_index)
        assert_same(b, a, range(10))
    # Without --data-cache-path the cache is Megatron's PREFIX/cache/BERTMaskedWordPieceDataset_indices.
    monkeypatch.undo()
    build_bert_datasets(DataConfig(data_path=[corpus["a"]], split="8,1,1"), tok, 64, 11, (50, 10, 2),
                        mask_prob=0.15, short_seq_prob=0.1, binary_head=True)
    default = Path(corpus["a"]) / "cache" / "BERTMaskedWordPieceDataset_indices"
    for ds in first:
        assert (default / f"{ds.unique_description_hash}-BERTMaskedWordPieceDataset-sample_index.npy").is_file()


class _PadIsEod:
    """The WordPiece tokenizer with a pad id that collides with eod."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    @property
    def pad(self):
        return self._tok.eod


def test_pad_colliding_with_eod_becomes_minus_one(corpus):
    tok = _PadIsEod(corpus["tokenizer"])
    with pytest.warns(UserWarning, match="pad token"):
        train = build_bert_datasets(DataConfig(data_path=[corpus["a"]], split="1,0,0"), tok, 128, 5,
                                    (30, 0, 0), mask_prob=0.15, short_seq_prob=0.1, binary_head=True)[0]
    ref = ref_dataset(corpus["a"], tok, 0, IndexedDataset(corpus["a"]).num_documents, 30, 128, 5, 0.15, 0.1,
                      True)
    assert ref._pad_token_id == -1
    assert_same(train, ref, range(30))
    sample = train[0]
    assert not np.any(sample["labels"] == -1)  # labels == pad (-1) became 0, as in Megatron
    assert np.any(sample["padding_mask"] == -1) and np.any(sample["types"] == -1)


def test_collate_gives_tensors(corpus):
    train = build_bert_datasets(DataConfig(data_path=[corpus["a"]], split="1,0,0"), corpus["tokenizer"], 32,
                                1, (4, 0, 0), mask_prob=0.15, short_seq_prob=0.1, binary_head=True)[0]
    batch = collate_samples([train[i] for i in range(3)])
    assert set(batch) == set(FIELDS)
    assert all(v.dtype == torch.int64 for v in batch.values())
    assert batch["text"].shape == (3, 32) and batch["is_random"].shape == (3,)
    assert batch["is_random"].tolist() == [train[i]["is_random"] for i in range(3)]


# ============================================================================ refusals

def test_document_level_data(corpus):
    tok = corpus["tokenizer"]
    cfg = DataConfig(data_path=[corpus["doc"]], split="1,0,0")
    with pytest.raises(ValueError, match="--split-sentences") as e:
        build_bert_datasets(cfg, tok, 64, 1, (10, 0, 0), mask_prob=0.15, short_seq_prob=0.1, binary_head=True)
    assert corpus["doc"] in str(e.value)
    # Without the binary head one sentence (here: one document) per sample is enough.
    train = build_bert_datasets(cfg, tok, 64, 1, (10, 0, 0), mask_prob=0.15, short_seq_prob=0.1,
                                binary_head=False)[0]
    ref = ref_dataset(corpus["doc"], tok, 0, IndexedDataset(corpus["doc"]).num_documents, 10, 64, 1, 0.15,
                      0.1, False)
    assert_same(train, ref, range(10))


def test_documents_with_only_long_sentences(tmp_path, corpus):
    prefix = str(tmp_path / "long")
    w = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(5):
        w.add_sequences_as_document([np.full(600, 10), np.full(20, 11)])
    w.finalize()
    with pytest.raises(ValueError, match="longer than 512 tokens") as e:
        build_bert_datasets(DataConfig(data_path=[prefix], split="1,0,0"), corpus["tokenizer"], 64, 1,
                            (10, 0, 0), mask_prob=0.15, short_seq_prob=0.1, binary_head=True)
    assert prefix in str(e.value)


def test_refused_tokenizers_and_flags(corpus):
    cfg = DataConfig(data_path=[corpus["a"]], split="1,0,0")
    tok = corpus["tokenizer"]
    kw = dict(mask_prob=0.15, short_seq_prob=0.1, binary_head=True)
    with pytest.raises(ValueError, match=r"--tokenizer-type NullTokenizer has no \[CLS\]/\[SEP\]/\[MASK\]/\[PAD\] "
                                         r"tokens; BERT needs BertWordPieceLowerCase or BertWordPieceCase"):
        build_bert_datasets(cfg, NullTokenizer(100), 64, 1, (10, 0, 0), **kw)
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="--mask-prob"):
            build_bert_datasets(cfg, tok, 64, 1, (10, 0, 0), **{**kw, "mask_prob": bad})
    for bad in (-0.1, 1.01):
        with pytest.raises(ValueError, match="--short-seq-prob"):
            build_bert_datasets(cfg, tok, 64, 1, (10, 0, 0), **{**kw, "short_seq_prob": bad})
    with pytest.raises(ValueError, match="--mock-data"):
        build_bert_datasets(DataConfig(mock_data=True), tok, 64, 1, (10, 0, 0), **kw)
    with pytest.raises(ValueError, match="--seq-length"):
        build_bert_datasets(cfg, tok, 4, 1, (10, 0, 0), **kw)
    with pytest.raises(ValueError, match="--seed"):
        build_bert_datasets(cfg, tok, 64, 0, (10, 0, 0), **kw)


def test_gpt2_tokenizer_is_refused(corpus):
    gpt2 = ROOT / ".." / "shared" / "data" / "gpt2"
    if not (gpt2 / "gpt2-vocab.json").is_file():
        pytest.skip(f"GPT-2 files not found in {gpt2}")
    from megatrain.data.tokenizers import TokenizerConfig, build_tokenizer

    tok = build_tokenizer(TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(gpt2 / "gpt2-vocab.json"),
                                          merge_file=str(gpt2 / "gpt2-merges.txt")))
    with pytest.raises(ValueError, match="--tokenizer-type GPT2BPETokenizer has no"):
        build_bert_datasets(DataConfig(data_path=[corpus["a"]]), tok, 64, 1, (10, 0, 0), mask_prob=0.15,
                            short_seq_prob=0.1, binary_head=True)


# ============================================================================ the command

def test_dataset_info_dumps_bert_samples(corpus, tmp_path):
    out = tmp_path / "first.npz"
    cmd = [sys.executable, str(ROOT / "tools" / "dataset_info.py"), "--data-path", corpus["a"], "--split", "8,1,1",
           "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", corpus["vocab"], "--seq-length", "64",
           "--seed", "21", "--mask-prob", "0.2", "--short-seq-prob", "0.3", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--train-iters", "20", "--eval-interval", "10", "--eval-iters", "2",
           "--data-cache-path", str(tmp_path / "cache"), "--dump-samples", "12", "--output", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    indexed = IndexedDataset(corpus["a"])
    assert f"documents: {indexed.num_documents}  sentences: {len(indexed)}" in res.stdout
    assert "train: documents [0, 240) = 240" in res.stdout
    got = np.load(out)
    assert sorted(got.files) == sorted(FIELDS)
    assert got["text"].shape == (12, 64) and got["is_random"].shape == (12,)
    ref = ref_dataset(corpus["a"], corpus["tokenizer"], 0, 240, 80, 64, 21, 0.2, 0.3, True)
    for key in FIELDS:
        np.testing.assert_array_equal(got[key], np.stack([np.asarray(ref[i][key]) for i in range(12)]))
    assert not list(tmp_path.glob("first.npz.*"))
    # GPT data flags with --model-family bert, and a BERT flag on document-level data: one-line errors.
    bad = subprocess.run(cmd[:2] + ["--data-path", corpus["doc"], "--split", "1,0,0", "--tokenizer-type",
                                    "BertWordPieceLowerCase", "--vocab-file", corpus["vocab"], "--seq-length", "64",
                                    "--global-batch-size", "4", "--train-iters", "2", "--model-family", "bert",
                                    "--dump-samples", "2", "--output", str(tmp_path / "x.npz")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--split-sentences" in bad.stderr and "Traceback" not in bad.stderr
