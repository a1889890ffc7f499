"""GPT dataset sample order checked against a plain-loop transcription of Megatron's algorithm."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megatrain.data.config import DataConfig
from megatrain.data.gpt_dataset import (
    GPTDataset,
    build_indices,
    build_train_valid_test_datasets,
    num_samples_for_splits,
    parse_blend,
    parse_split,
    split_matrix_from_vector,
    split_ranges,
)
from megatrain.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter


# ----------------------------------------------------------------------------- reference (loops)

def ref_indices(sizes, documents, num_samples, seq_length, seed):
    """Straightforward transcription of Megatron's GPTDataset index building (no numpy tricks)."""
    sizes = [int(x) for x in sizes]
    documents = [int(d) for d in documents]
    tokens_per_epoch = sum(sizes[d] for d in documents)
    num_epochs = 1
    while num_epochs * tokens_per_epoch < num_samples * seq_length + 1:
        num_epochs += 1
    separate = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        from_final = num_samples - sans_final
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = from_final < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)

    def doc_index(epochs):
        arr = np.array([d for _ in range(epochs) for d in documents], dtype=np.int32)
        rng.shuffle(arr)
        return list(arr)

    if separate:
        document_index = doc_index(num_epochs - 1) + doc_index(1)
    else:
        document_index = doc_index(num_epochs)

    # helpers.cpp build_sample_idx, loop for loop
    n = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = [(0, 0)]
    j, offset = 0, 0
    while len(sample_idx) <= n:
        remaining = seq_length + 1
        while remaining != 0:
            doc_len = sizes[document_index[j]] - offset
            remaining -= doc_len
            if remaining <= 0:
                offset += remaining + doc_len - 1
                remaining = 0
            else:
                if j == len(document_index) - 1:
                    raise AssertionError("ran out of documents")
                j += 1
                offset = 0
        sample_idx.append((j, offset))

    def perm(lo, hi):
        arr = np.arange(lo, hi, dtype=np.int64)
        rng.shuffle(arr)
        return list(arr)

    shuffle = perm(0, sans_final) + perm(sans_final, n) if separate else perm(0, n)
    return document_index, sample_idx, shuffle, num_epochs, separate


def ref_sample_tokens(ds_tokens, document_index, shuffle, seq_length, i):
    stream = [t for d in document_index for t in ds_tokens[d]]
    k = shuffle[i]
    return stream[k * seq_length: k * seq_length + seq_length + 1]


def write_dataset(prefix, docs, dtype=np.uint16):
    w = IndexedDatasetWriter(str(prefix), dtype)
    for d in docs:
        w.add_document(np.asarray(d, dtype=np.int64))
    w.finalize()
    return str(prefix)


def random_docs(rng, n, max_len=40, zero_frac=0.0, vocab=1000):
    docs = []
    for _ in range(n):
        length = 0 if rng.random() < zero_frac else int(rng.integers(1, max_len))
        docs.append(rng.integers(0, vocab, size=length))
    return docs


def check_against_reference(sizes, documents, num_samples, seq_length, seed):
    got = build_indices(np.asarray(sizes, dtype=np.int32), np.asarray(documents, dtype=np.int32),
                        num_samples, seq_length, seed)
    d_ref, s_ref, sh_ref, epochs, separate = ref_indices(sizes, documents, num_samples, seq_length, seed)
    assert got["num_epochs"] == epochs
    assert got["separate_final_epoch"] == separate
    assert got["document_index"].dtype == np.int32
    np.testing.assert_array_equal(got["document_index"], np.asarray(d_ref))
    np.testing.assert_array_equal(got["sample_index"], np.asarray(s_ref))
    np.testing.assert_array_equal(got["shuffle_index"].astype(np.int64), np.asarray(sh_ref))
    return got, epochs, separate


# ----------------------------------------------------------------------------- index order

def test_single_epoch_matches_reference():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 50, size=300)
    got, epochs, _ = check_against_reference(sizes, np.arange(300), 100, 16, 1234)
    assert epochs == 1


@pytest.mark.parametrize("num_samples,expect_separate", [(110, True), (148, False)])
def test_multi_epoch_both_sides_of_80_percent(num_samples, expect_separate):
    # 60 documents of 20 tokens: 1200 tokens/epoch, (1200-1)//8 = 149 samples per epoch.
    sizes = np.full(60, 20)
    _, epochs, separate = check_against_reference(sizes, np.arange(60), 149 + num_samples, 8, 7)
    assert epochs == 2
    assert separate is expect_separate


def test_many_epochs_separate_final():
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 30, size=25)
    _, epochs, separate = check_against_reference(sizes, np.arange(5, 25), 500, 8, 99)
    assert epochs > 3


def test_zero_length_documents_and_exact_document_ends():
    # documents of exactly seq_length+1 and seq_length tokens make samples end on document
    # ends; zero-length documents sit everywhere, including first and last.
    sizes = [0, 9, 8, 0, 0, 8, 1, 0, 17, 16, 0, 8, 9, 0]
    for seed in range(20):
        check_against_reference(sizes, np.arange(len(sizes)), 30, 8, seed)
    rng = np.random.default_rng(1)
    sizes = [0 if rng.random() < 0.3 else int(rng.integers(1, 12)) for _ in range(200)]
    check_against_reference(sizes, np.arange(200), 400, 4, 5)


def test_samples_are_the_reference_tokens(tmp_path):
    rng = np.random.default_rng(2)
    docs = random_docs(rng, 80, zero_frac=0.1)
    prefix = write_dataset(tmp_path / "corpus", docs)
    indexed = IndexedDataset(prefix)
    ds = GPTDataset(indexed, prefix, np.arange(10, 70, dtype=np.int32), 150, "train", 16, 42, None)
    d_ref, _, sh_ref, _, _ = ref_indices(indexed.sequence_lengths, range(10, 70), 150, 16, 42)
    assert len(ds) >= 150
    for i in list(range(20)) + [len(ds) - 1]:
        sample = ds[i]
        assert sample.dtype == np.int64 and sample.shape == (17,)
        assert sample.tolist() == ref_sample_tokens([list(d) for d in docs], d_ref, sh_ref, 16, i)


# ----------------------------------------------------------------------------- flags -> numbers

def test_num_samples_for_splits():
    assert num_samples_for_splits(100, None, 8, 10, 5) == (800, (100 // 10 + 1) * 5 * 8, 40)
    # --train-samples: train_iters derived as train_samples // global batch
    assert num_samples_for_splits(None, 1000, 8, 50, 2) == (1000, (125 // 50 + 1) * 2 * 8, 16)


def test_split_parsing_and_ranges():
    assert parse_split("969, 30, 1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("99,1") == pytest.approx([0.99, 0.01, 0.0])
    matrix = split_matrix_from_vector(parse_split("98,2,0"))
    assert matrix[2] is None
    assert split_ranges(1000, matrix)[:2] == [(0, 980), (980, 1000)]
    for bad in ("abc", "", "0,0,0", "1,2,3,4", "1.2.3,4"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)


def test_split_ignores_non_numeric_characters_as_megatron_does():
    # Megatron-LM keeps only the runs of digits and dots: quotes that bash arrays pass literally
    # (its llama3 / megatron_fsdp / gptoss scripts), spaces and other separators.
    for text in ("'99,1,0'", '"99,1,0"', "99 1 0", "99/1/0", "99;1x0", "99,1"):
        assert parse_split(text) == pytest.approx([0.99, 0.01, 0.0]), text
    assert parse_split("1,-2,3") == pytest.approx([1 / 6, 2 / 6, 3 / 6])  # '-' is not part of a number there


def test_blend_parsing():
    assert parse_blend(["a"]) == (["a"], None)
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(ValueError, match="--data-path.*'x'"):
        parse_blend(["0.3", "a", "x", "b"])
    with pytest.raises(ValueError, match="positive"):
        parse_blend(["-1", "a", "2", "b"], "--data-path")


# ----------------------------------------------------------------------------- builder, cache, errors

def test_builder_cache_files_and_reload(tmp_path):
    rng = np.random.default_rng(4)
    prefix = write_dataset(tmp_path / "c_text_document", random_docs(rng, 200))
    cfg = DataConfig(data_path=[prefix], split="90,8,2")
    train, valid, test = build_train_valid_test_datasets(cfg, 16, 1234, (64, 32, 8))
    cache = os.path.join(prefix, "cache", "GPTDataset_indices")
    names = sorted(os.listdir(cache))
    for split in ("train", "valid", "test"):
        for kind in ("document_index", "sample_index", "shuffle_index"):
            assert any(n.endswith(f"-GPTDataset-{split}-{kind}.npy") for n in names), names
        assert any(n.endswith(f"-GPTDataset-{split}-description.txt") for n in names)
    assert not any(n.endswith(".tmp") for n in names)
    again = build_train_valid_test_datasets(cfg, 16, 1234, (64, 32, 8))
    for a, b in zip((train, valid, test), again):
        assert isinstance(b.sample_index, np.memmap)  # loaded from the cache
        for kind in ("document_index", "sample_index", "shuffle_index"):
            np.testing.assert_array_equal(getattr(a, kind), getattr(b, kind))
        np.testing.assert_array_equal(a[0], b[0])
    # a different seed is a different cache entry
    other = build_train_valid_test_datasets(cfg, 16, 5, (64, 32, 8))[0]
    assert not isinstance(other.sample_index, np.memmap)


def test_bad_inputs_name_the_flag(tmp_path):
    cfg = DataConfig(data_path=[str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="--data-path.*missing"):
        build_train_valid_test_datasets(cfg, 8, 1, (10, 1, 1))
    rng = np.random.default_rng(0)
    prefix = write_dataset(tmp_path / "d", random_docs(rng, 20))
    with pytest.raises(ValueError, match="--data-path"):
        build_train_valid_test_datasets(DataConfig(data_path=["0.5", prefix, "zz", prefix]), 8, 1, (10, 1, 1))
    with pytest.raises(ValueError, match="--split"):
        build_train_valid_test_datasets(DataConfig(data_path=[prefix], split="a,b"), 8, 1, (10, 1, 1))
    with pytest.raises(ValueError, match="--train-data-path"):
        build_train_valid_test_datasets(DataConfig(train_data_path=[str(tmp_path / "nope")]), 8, 1, (10, 1, 1))


def test_per_split_paths_and_mock(tmp_path):
    rng = np.random.default_rng(6)
    a = write_dataset(tmp_path / "a", random_docs(rng, 50))
    b = write_dataset(tmp_path / "b", random_docs(rng, 30))
    cfg = DataConfig(train_data_path=[a], valid_data_path=[b], data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(cfg, 8, 3, (40, 10, 5))
    assert test is None and len(train) >= 40 and len(valid) >= 10
    assert train.documents.tolist() == list(range(50))  # whole file for its split
    assert len(os.listdir(tmp_path / "cache")) == 8
    mock = build_train_valid_test_datasets(DataConfig(mock_data=True), 32, 1, (20, 4, 4),
                                           tokenizer_vocab_size=50257, eod=50256)
    sample = mock[0][0]
    assert sample.shape == (33,) and sample.dtype == np.int64
    assert mock[0][0].tolist() == build_train_valid_test_datasets(
        DataConfig(mock_data=True), 32, 1, (20, 4, 4), 50257, 50256)[0][0].tolist()
