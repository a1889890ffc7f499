"""T5 span-corruption samples, sample for sample against Megatron-LM's algorithm.

The reference below is a plain transcription of megatron-core's ``t5_dataset.py``
(``__getitem__``, ``_get_token_mask``) and ``masked_dataset.py`` (``_create_masked_lm_predictions``
with the geometric branch) with ``pretrain_t5.py``'s settings; the sample index and the
Mersenne Twisters are the BERT test's plain transcription of ``helpers.cpp``. The package's
datasets are compared with it field by field on data made by the real
``tools/preprocess_data.py --split-sentences``.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections import deque

import numpy as np
import pytest

from megatrain.data import bert_dataset as bert_dataset_module
from megatrain.data.config import DataConfig
from megatrain.data.indexed_dataset import IndexedDataset
from megatrain.data.masked_lm import mask_tokens, wordpiece_tables
from megatrain.data.t5_dataset import T5MaskedWordPieceDataset, build_t5_datasets, check_t5_tokenizer
from megatrain.data.tokenizers import BertWordPieceTokenizer, NullTokenizer
from tests.unit.test_bert_dataset import (
    ROOT,
    preprocess,
    ref_blending_indices,
    ref_build_mapping,
    ref_split,
    write_corpus,
    write_vocab,
)

FIELDS = ("text_enc", "text_dec", "labels", "loss_mask", "truncated", "enc_mask", "dec_mask")


# ============================================================================ the reference

class RefT5Dataset:
    """T5MaskedWordPieceDataset.__getitem__ and _create_masked_lm_predictions, transcribed."""

    def __init__(self, dataset, sample_index, tokenizer, sequence_length_encoder, sequence_length_decoder,
                 random_seed, masking_probability):
        self.dataset = dataset
        self.sample_index = sample_index
        self.tokenizer = tokenizer
        self.sequence_length_encoder = sequence_length_encoder
        self.sequence_length_decoder = sequence_length_decoder
        self.random_seed = random_seed
        self.masking_probability = masking_probability
        self.masking_max_ngram = 10
        self.masking_do_full_word = True
        self.masking_use_geometric_distribution = True
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
        assert target_sequence_length <= self.sequence_length_encoder
        tokens = [int(token) for sentence in sample for token in sentence]
        truncated = len(tokens) > target_sequence_length
        tokens = tokens[:target_sequence_length]
        tokens, _, _, _, masked_spans = self._create_masked_lm_predictions(
            tokens, target_sequence_length, numpy_random_state)
        sentinels = deque(self.tokenizer.additional_special_tokens_ids)
        encoder_input = []
        decoder_input = [self.tokenizer.bos]
        decoder_output = []
        idx_beg = 0
        for indices, labels in masked_spans:
            sentinel = sentinels.popleft()
            idx_end = indices[0]
            encoder_input.extend(tokens[idx_beg:idx_end])
            encoder_input.append(sentinel)
            decoder_input.append(sentinel)
            decoder_input.extend(labels)
            decoder_output.append(sentinel)
            decoder_output.extend(labels)
            idx_beg = indices[-1] + 1
        encoder_input.extend(tokens[idx_beg:])
        decoder_output.append(self.tokenizer.eos)
        length_toks_encoder = len(encoder_input)
        length_toks_decoder = len(decoder_input)
        length_pads_encoder = self.sequence_length_encoder - length_toks_encoder
        length_pads_decoder = self.sequence_length_decoder - length_toks_decoder
        assert length_pads_encoder >= 0
        assert length_pads_decoder >= 0
        encoder_input = np.array(encoder_input, dtype=np.int64)
        encoder_input = np.pad(encoder_input, (0, length_pads_encoder), constant_values=self._pad_token_id)
        decoder_input = np.array(decoder_input, dtype=np.int64)
        decoder_input = np.pad(decoder_input, (0, length_pads_decoder), constant_values=self._pad_token_id)
        mask_encoder = np.ones(self.sequence_length_encoder, dtype=np.int64)
        mask_encoder[encoder_input == self._pad_token_id] = 0
        mask_decoder = np.ones(self.sequence_length_decoder, dtype=np.int64)
        mask_decoder[decoder_input == self._pad_token_id] = 0
        decoder_output = np.array(decoder_output, dtype=np.int64)
        decoder_output = np.pad(decoder_output, (0, length_pads_decoder), constant_values=-1)
        loss_mask = np.zeros(self.sequence_length_decoder, dtype=np.int64)
        loss_mask[:length_toks_decoder] = 1
        encoder_input[encoder_input == self._pad_token_id] = 0
        decoder_input[decoder_input == self._pad_token_id] = 0
        decoder_output[decoder_output == self._pad_token_id] = 0
        return {"text_enc": encoder_input, "text_dec": decoder_input, "labels": decoder_output,
                "loss_mask": loss_mask, "truncated": int(truncated), "enc_mask": mask_encoder,
                "dec_mask": mask_decoder}

    def _get_token_mask(self, numpy_random_state):
        return self.tokenizer.mask

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
        masked_spans = []
        masked_indices = set()
        for candidate_idx in range(len(candidate_ngrams)):
            n_ngrams = len(candidate_ngrams[candidate_idx])
            if len(masked_positions_and_labels) >= n_maskings:
                break
            if not candidate_ngrams[candidate_idx]:
                continue
            if self.masking_use_geometric_distribution:
                p = 0.2
                n = min(numpy_random_state.geometric(p), self.masking_max_ngram)
            else:
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
            masked_spans.append((ngram_indices, [token_ids[index] for index in ngram_indices]))
        assert len(masked_positions_and_labels) <= n_maskings
        numpy_random_state.shuffle(candidate_ngrams)
        masked_positions_and_labels = sorted(masked_positions_and_labels, key=lambda x: x[0])
        masked_positions = [position for position, _ in masked_positions_and_labels]
        masked_labels = [label for _, label in masked_positions_and_labels]
        masked_spans = sorted(masked_spans, key=lambda x: x[0][0])
        return masked_token_ids, masked_positions, masked_labels, boundaries, masked_spans


def ref_dataset(prefix, tokenizer, beg, end, num_samples, enc, dec, seed, mask_prob, short_seq_prob):
    """Megatron's T5 dataset over documents [beg, end) of ``prefix``."""
    indexed = IndexedDataset(prefix)
    indices = np.arange(beg, end, dtype=np.int32)
    docs = indexed.document_indices[np.append(indices, indices[-1] + 1)]
    if num_samples is None:  # one epoch
        mapping = ref_build_mapping(docs, indexed.sequence_lengths, 1, 2**64 - 1, enc - 2, short_seq_prob, seed, 1)
    else:
        mapping = ref_build_mapping(docs, indexed.sequence_lengths, 2**31 - 2, num_samples, enc - 2,
                                    short_seq_prob, seed, 1)
    return RefT5Dataset(indexed, mapping, tokenizer, enc, dec, seed, mask_prob)


# ============================================================================ data

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5_corpus")
    vocab = write_vocab(root / "vocab.txt")
    preprocess(write_corpus(root / "a.jsonl", 160, 3, max_words=30), str(root / "a"), vocab, "--split-sentences")
    preprocess(write_corpus(root / "b.jsonl", 80, 4), str(root / "b"), vocab, "--split-sentences")
    preprocess(write_corpus(root / "d.jsonl", 30, 5), str(root / "d"), vocab)  # document level
    return {"root": root, "vocab": vocab, "tokenizer": BertWordPieceTokenizer(vocab, vocab_extra_ids=100),
            "a": str(root / "a_text_sentence"), "b": str(root / "b_text_sentence"),
            "doc": str(root / "d_text_document")}


def assert_same(got, ref, indices):
    for i in indices:
        want, have = ref[i], got[i]
        assert list(have) == list(FIELDS)
        for key in FIELDS:
            if key == "truncated":
                assert isinstance(have[key], int) and have[key] == want[key], (i, key)
            else:
                assert have[key].dtype == np.int64 and have[key].shape == want[key].shape, (i, key)
                np.testing.assert_array_equal(have[key], want[key], err_msg=f"sample {i}, field {key}")


def decoded_spans(sample, tok):
    """The masked spans of a sample, as word pieces, from its labels (sentinel span sentinel span ...)."""
    labels = sample["labels"][sample["loss_mask"] == 1].tolist()
    marks = set(tok.additional_special_tokens_ids) | {tok.eos}
    spans, current = [], None
    for t in labels:
        if t in marks:
            if current is not None:
                spans.append(current)
            current = []
        else:
            current.append(tok.inv_vocab[t])
    return spans


# ============================================================================ the tokenizer

def test_sentinels_follow_the_vocabulary(corpus):
    tok = corpus["tokenizer"]
    base = len(BertWordPieceTokenizer(corpus["vocab"]).vocab)
    assert tok.additional_special_tokens == [f"<extra_id_{i}>" for i in range(100)]
    assert tok.additional_special_tokens_ids == list(range(base, base + 100))
    assert tok.vocab_size == base + 100
    assert (tok.bos, tok.eos) == (tok.cls, tok.sep)  # current Megatron-LM: bos = [CLS], eos = [SEP]
    assert BertWordPieceTokenizer(corpus["vocab"]).additional_special_tokens_ids == []


# ============================================================================ the masking

def test_geometric_masking_matches_the_transcription(corpus):
    tok = corpus["tokenizer"]
    tables = wordpiece_tables(tok)
    ref = RefT5Dataset(None, None, tok, 0, 0, 0, 0.15)
    indexed = IndexedDataset(corpus["a"])
    rng = np.random.default_rng(0)
    for trial in range(150):
        first = int(rng.integers(0, len(indexed) - 8))
        tokens = np.concatenate(indexed[first:first + int(rng.integers(1, 8))]).astype(np.int64)
        if trial % 5 == 0:  # [CLS]/[SEP] are no candidates, and a span may stride over them
            tokens[rng.integers(0, tokens.size, size=2)] = (tok.cls, tok.sep)
        target = int(rng.integers(2, 120))
        ref.masking_probability = float(rng.choice([0.1, 0.15, 0.3, 0.6]))
        got = mask_tokens(tokens, target, ref.masking_probability, tables, np.random.RandomState(trial),
                          max_ngram=10, geometric=True, replace="mask")
        want = ref._create_masked_lm_predictions(tokens.tolist(), target, np.random.RandomState(trial))
        assert got.tokens.tolist() == want[0]
        assert got.positions.tolist() == want[1] and got.labels.tolist() == want[2]
        assert got.spans == [indices for indices, _ in want[4]]


# ============================================================================ the samples

@pytest.mark.parametrize("enc, dec, seed, mask_prob, short_seq_prob", [
    (128, 64, 1234, 0.15, 0.1),
    (64, 32, 7, 0.15, 0.0),
    (512, 128, 99, 0.15, 0.1),
    (48, 40, 5, 0.3, 1.0),
])
def test_samples_match_megatron(corpus, enc, dec, seed, mask_prob, short_seq_prob):
    tok = corpus["tokenizer"]
    sizes = (120, 30, 6)
    train, valid, test = build_t5_datasets(
        DataConfig(data_path=[corpus["a"]], split="8,1,1", data_cache_path=str(corpus["root"] / "cache")),
        tok, enc, dec, seed, sizes, mask_prob=mask_prob, short_seq_prob=short_seq_prob)
    num_docs = IndexedDataset(corpus["a"]).num_documents
    for ds, i, n in ((train, 0, sizes[0]), (valid, 1, sizes[1]), (test, 2, sizes[2])):
        assert isinstance(ds, T5MaskedWordPieceDataset)
        beg, end = ref_split(num_docs, "8,1,1", i)
        ref = ref_dataset(corpus["a"], tok, beg, end, n, enc, dec, seed, mask_prob, short_seq_prob)
        np.testing.assert_array_equal(np.asarray(ds.sample_index, dtype=np.int64), ref.sample_index)
        assert len(ds) == len(ref) >= n
        assert_same(ds, ref, range(n))
    # The samples met spans of several words, whole words of several pieces and truncation.
    spans = [span for i in range(len(train)) for span in decoded_spans(train[i], tok)]
    assert max(sum(not w.startswith("##") for w in span) for span in spans) >= 3
    assert any(w.startswith("##") for span in spans for w in span)
    assert any(train[i]["truncated"] for i in range(len(train)))
    sample = train[0]
    assert sample["text_dec"][0] == tok.bos and sample["labels"][sample["loss_mask"].sum() - 1] == tok.eos
    assert sample["text_dec"][1] == sample["labels"][0] == tok.additional_special_tokens_ids[0]


def test_blend_and_per_split_paths_match_megatron(corpus):
    tok = corpus["tokenizer"]
    n, enc, dec, seed = 80, 64, 32, 17
    cfg = DataConfig(data_path=["0.4", corpus["a"], "0.6", corpus["b"]], split="8,1,1",
                     data_cache_path=str(corpus["root"] / "cache"))
    train = build_t5_datasets(cfg, tok, enc, dec, seed, (n, 10, 10), mask_prob=0.15, short_seq_prob=0.1)[0]
    weights = [0.4, 0.6]
    refs = []
    for prefix, w in zip((corpus["a"], corpus["b"]), weights):
        beg, end = ref_split(IndexedDataset(prefix).num_documents, "8,1,1", 0)
        wanted = int(np.ceil(np.ceil(n * w) * 1.005))
        refs.append(ref_dataset(prefix, tok, beg, end, wanted, enc, dec, seed, 0.15, 0.1))
    size = sum(int(np.ceil(n * w)) for w in weights)
    assert len(train) == size
    which, sample = ref_blending_indices(weights, size)
    for i in range(size):
        want, have = refs[which[i]][sample[i]], train[i]
        for key in FIELDS:
            np.testing.assert_array_equal(np.asarray(have[key]), np.asarray(want[key]), err_msg=f"{i} {key}")
    train, valid, test = build_t5_datasets(DataConfig(train_data_path=[corpus["b"]], valid_data_path=[corpus["a"]]),
                                           tok, enc, dec, seed, (40, 20, 5), mask_prob=0.2, short_seq_prob=0.0)
    assert test is None
    for ds, prefix, k in ((train, corpus["b"], 40), (valid, corpus["a"], 20)):
        ref = ref_dataset(prefix, tok, 0, IndexedDataset(prefix).num_documents, k, enc, dec, seed, 0.2, 0.0)
        assert_same(ds, ref, range(k))


def test_document_level_data_is_used_as_megatron_does(corpus):
    tok = corpus["tokenizer"]
    with pytest.warns(UserWarning, match="document-level") as caught:
        train = build_t5_datasets(DataConfig(data_path=[corpus["doc"]], split="1,0,0"), tok, 64, 32, 3, (20, 0, 0),
                                  mask_prob=0.15, short_seq_prob=0.1)[0]
    assert corpus["doc"] in str(caught[0].message) and "--split-sentences" in str(caught[0].message)
    ref = ref_dataset(corpus["doc"], tok, 0, IndexedDataset(corpus["doc"]).num_documents, 20, 64, 32, 3, 0.15, 0.1)
    assert_same(train, ref, range(20))


def test_cache_is_reused(corpus, tmp_path, monkeypatch):
    tok = corpus["tokenizer"]
    cfg = DataConfig(data_path=[corpus["a"]], split="8,1,1", data_cache_path=str(tmp_path / "c"))
    first = build_t5_datasets(cfg, tok, 64, 32, 11, (30, 5, 2), mask_prob=0.15, short_seq_prob=0.1)
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert len(names) == 6 and all("-T5MaskedWordPieceDataset-" in n for n in names)
    description = (tmp_path / "c" / [n for n in names if n.endswith(".txt")][0]).read_text()
    assert '"sequence_length_decoder": 32' in description
    assert '"masking_use_geometric_distribution": true' in description

    def refuse(*args, **kwargs):
        raise AssertionError("the cached index was rebuilt")

    monkeypatch.setattr(bert_dataset_module, "build_mapping", refuse)
    second = build_t5_datasets(cfg, tok, 64, 32, 11, (30, 5, 2), mask_prob=0.15, short_seq_prob=0.1)
    for a, b in zip(first, second):
        assert isinstance(b.sample_index, np.memmap)
        assert_same(b, a, range(5))
    with pytest.raises(AssertionError, match="rebuilt"):  # another decoder length: another description
        build_t5_datasets(cfg, tok, 64, 48, 11, (30, 5, 2), mask_prob=0.15, short_seq_prob=0.1)


# ============================================================================ refusals

def test_refusals(corpus):
    tok = corpus["tokenizer"]
    cfg = DataConfig(data_path=[corpus["a"]], split="1,0,0")
    kw = dict(mask_prob=0.15, short_seq_prob=0.1)
    no_sentinels = BertWordPieceTokenizer(corpus["vocab"])
    with pytest.raises(ValueError, match="no sentinel tokens: T5's span corruption needs --vocab-extra-ids"):
        build_t5_datasets(cfg, no_sentinels, 64, 32, 1, (10, 0, 0), **kw)
    with pytest.raises(ValueError, match="--vocab-extra-ids"):
        check_t5_tokenizer(no_sentinels)
    with pytest.raises(ValueError, match=r"--tokenizer-type NullTokenizer has no \[CLS\]"):
        check_t5_tokenizer(NullTokenizer(100))
    check_t5_tokenizer(tok)
    # The decoder too short for the spans of a sample: Megatron asserts, we name the flag.
    train = build_t5_datasets(cfg, tok, 128, 4, 1, (10, 0, 0), **kw)[0]
    with pytest.raises(ValueError, match=r"sample 0 of .* needs \d+ decoder positions .* --decoder-seq-length "
                                         r"is 4 .*raise --decoder-seq-length") as e:
        train[0]
    assert "\n" not in str(e.value)
    # Fewer sentinels than spans.
    train = build_t5_datasets(cfg, BertWordPieceTokenizer(corpus["vocab"], vocab_extra_ids=1), 128, 64, 1,
                              (10, 0, 0), **kw)[0]
    with pytest.raises(ValueError, match=r"masks \d+ spans but the tokenizer has 1 sentinels: raise --vocab-extra-ids"):
        for i in range(10):
            train[i]
    for bad, flag in ((dict(encoder_seq_length=3), "--encoder-seq-length"),
                      (dict(decoder_seq_length=0), "--decoder-seq-length"), (dict(seed=0), "--seed"),
                      (dict(mask_prob=1.0), "--mask-prob"), (dict(short_seq_prob=2.0), "--short-seq-prob")):
        args = dict(encoder_seq_length=64, decoder_seq_length=32, seed=1, **kw)
        args.update(bad)
        with pytest.raises(ValueError, match=flag):
            build_t5_datasets(cfg, tok, args.pop("encoder_seq_length"), args.pop("decoder_seq_length"),
                              args.pop("seed"), (10, 0, 0), **args)
    with pytest.raises(ValueError, match="--mock-data"):
        build_t5_datasets(DataConfig(mock_data=True), tok, 64, 32, 1, (10, 0, 0), **kw)


# ============================================================================ the command

def test_dataset_info_dumps_t5_samples(corpus, tmp_path):
    out = tmp_path / "first.npz"
    cmd = [sys.executable, str(ROOT / "tools" / "dataset_info.py"), "--data-path", corpus["a"], "--split", "8,1,1",
           "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", corpus["vocab"], "--vocab-extra-ids", "100",
           "--encoder-seq-length", "64", "--decoder-seq-length", "32", "--seed", "21", "--mask-prob", "0.2",
           "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "20", "--eval-interval", "10",
           "--eval-iters", "2", "--data-cache-path", str(tmp_path / "cache"), "--dump-samples", "12",
           "--output", str(out)]
    with warnings.catch_warnings():
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "T5 span-corruption data" in res.stdout and "train: documents [0, 128) = 128" in res.stdout
    got = np.load(out)
    assert sorted(got.files) == sorted(FIELDS)
    assert got["text_enc"].shape == (12, 64) and got["labels"].shape == (12, 32) and got["truncated"].shape == (12,)
    ref = ref_dataset(corpus["a"], corpus["tokenizer"], 0, 128, 80, 64, 32, 21, 0.2, 0.1)
    for key in FIELDS:
        np.testing.assert_array_equal(got[key], np.stack([np.asarray(ref[i][key]) for i in range(12)]))
    # Without sentinels: one line naming the flag.
    bad = subprocess.run([a for a in cmd if a not in ("--vocab-extra-ids", "100")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "--vocab-extra-ids" in bad.stderr and "Traceback" not in bad.stderr
