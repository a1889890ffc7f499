"""Megatron MMIDIDX files: writer/reader round trip, byte-exact layout, validation."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from megatrain.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    dataset_exists,
)

CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6,
         np.float32: 7, np.uint16: 8}


def reference_write(prefix, dtype, documents):
    """Minimal writer straight from the format table: documents is a list of lists of sentences."""
    lengths, pointers, doc_idx = [], [], [0]
    offset = 0
    with open(f"{prefix}.bin", "wb") as f:
        for doc in documents:
            for sent in doc:
                f.write(np.array(sent, dtype=dtype).tobytes())
                lengths.append(len(sent))
                pointers.append(offset)
                offset += len(sent) * np.dtype(dtype).itemsize
            doc_idx.append(len(lengths))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def read_bytes(prefix):
    return open(f"{prefix}.bin", "rb").read(), open(f"{prefix}.idx", "rb").read()


DOCS = [[5, 6, 7], [1], [9, 9, 9, 9, 9], [65000, 0, 3]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_round_trip_and_byte_identical_to_reference(tmp_path, dtype):
    docs = [[t % 250 for t in d] for d in DOCS] if dtype == np.uint8 else DOCS
    with IndexedDatasetWriter(tmp_path / "ours", dtype) as w:
        for d in docs:
            w.add_document(d)
    reference_write(tmp_path / "ref", dtype, [[d] for d in docs])
    assert read_bytes(tmp_path / "ours") == read_bytes(tmp_path / "ref")

    ds = IndexedDataset(tmp_path / "ours")
    assert len(ds) == len(docs)
    assert ds.dtype == np.dtype(dtype)
    assert ds.sequence_lengths.dtype == np.int32 and ds.sequence_pointers.dtype == np.int64
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d
    assert ds.get(2, offset=1, length=3).tolist() == docs[2][1:4]
    assert ds.get(0, offset=1).tolist() == docs[0][1:]
    assert [a.tolist() for a in ds[1:3]] == docs[1:3]
    assert ds[-1].tolist() == docs[-1]


def test_get_is_zero_copy(tmp_path):
    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as w:
        w.add_document(list(range(100)))
    ds = IndexedDataset(tmp_path / "d")
    view = ds.get(0, 10, 20)
    assert not view.flags.owndata
    assert isinstance(view.base, np.memmap) or isinstance(view, np.memmap)


def test_sentence_split_documents_match_reference_and_megatron_layout(tmp_path):
    docs = [[[1, 2], [3], [4, 5, 6]], [[7]], [[8, 9], [10, 11]]]
    with IndexedDatasetWriter(tmp_path / "ours", np.uint16) as w:
        w.add_sequences_as_document(docs[0])
        w.add_document([7])
        # Megatron's add_document(ids, lengths) form
        w.add_document([8, 9, 10, 11], lengths=[2, 2])
    reference_write(tmp_path / "ref", np.uint16, docs)
    assert read_bytes(tmp_path / "ours") == read_bytes(tmp_path / "ref")
    ds = IndexedDataset(tmp_path / "ref")
    assert len(ds) == 6
    assert ds.sequence_lengths.tolist() == [2, 1, 3, 1, 2, 2]
    assert ds.sequence_pointers.tolist() == [0, 4, 6, 12, 14, 18]
    assert ds.document_indices.tolist() == [0, 3, 4, 6]
    assert ds.num_documents == 3
    assert ds[2].tolist() == [4, 5, 6]


def test_add_index_merges_like_concatenation(tmp_path):
    a = [[[1, 2], [3]], [[4]]]
    b = [[[5]], [[6, 7], [8, 9, 10]]]
    reference_write(tmp_path / "a", np.uint16, a)
    reference_write(tmp_path / "b", np.uint16, b)
    reference_write(tmp_path / "ab_ref", np.uint16, a + b)
    with IndexedDatasetWriter(tmp_path / "ab", np.uint16) as w:
        w.add_index(tmp_path / "a")
        w.add_index(tmp_path / "b")
    assert read_bytes(tmp_path / "ab") == read_bytes(tmp_path / "ab_ref")


def test_add_index_refuses_dtype_mismatch(tmp_path):
    reference_write(tmp_path / "a", np.int32, [[[1]]])
    w = IndexedDatasetWriter(tmp_path / "out", np.uint16)
    with pytest.raises(ValueError, match="dtype"):
        w.add_index(tmp_path / "a")
    w.abort()
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx"]
    assert not dataset_exists(tmp_path / "out")


def test_empty_dataset_round_trip(tmp_path):
    IndexedDatasetWriter(tmp_path / "e", np.uint16).finalize()
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]


def test_best_dtype():
    assert best_dtype(50257) is np.uint16
    assert best_dtype(65499) is np.uint16
    assert best_dtype(65500) is np.int32
    assert best_dtype(128256) is np.int32


def test_writer_refuses_ids_that_do_not_fit(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "x", np.uint16)
    with pytest.raises(ValueError, match="70000 does not fit.*uint16"):
        w.add_document([1, 70000])
    with pytest.raises(ValueError, match="-1 does not fit"):
        w.add_document([-1])
    w.abort()
    assert os.listdir(tmp_path) == []


def test_exception_inside_writer_leaves_no_files(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetWriter(tmp_path / "y", np.uint16) as w:
            w.add_document([1, 2, 3])
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_files_appear_only_on_finalize(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "x", np.uint16)
    w.add_document([1, 2])
    assert not os.path.exists(tmp_path / "x.bin") and not os.path.exists(tmp_path / "x.idx")
    w.finalize()
    assert sorted(os.listdir(tmp_path)) == ["x.bin", "x.idx"]


def test_missing_files_named(tmp_path):
    with pytest.raises(ValueError, match=r"missing file\(s\) .*nothing\.idx.*nothing\.bin"):
        IndexedDataset(tmp_path / "nothing")
    reference_write(tmp_path / "d", np.uint16, [[[1]]])
    os.remove(tmp_path / "d.bin")
    with pytest.raises(ValueError, match=r"missing file\(s\) [^,]*d\.bin"):
        IndexedDataset(tmp_path / "d")


def _patch(path, offset, data):
    raw = bytearray(open(path, "rb").read())
    raw[offset : offset + len(data)] = data
    open(path, "wb").write(bytes(raw))


def test_bad_header_fields(tmp_path):
    reference_write(tmp_path / "d", np.uint16, [[[1, 2]]])
    good = open(tmp_path / "d.idx", "rb").read()
    _patch(tmp_path / "d.idx", 0, b"XXIDIDX")
    with pytest.raises(ValueError, match="bad magic"):
        IndexedDataset(tmp_path / "d")
    open(tmp_path / "d.idx", "wb").write(good)
    _patch(tmp_path / "d.idx", 9, struct.pack("<Q", 2))
    with pytest.raises(ValueError, match="version 2"):
        IndexedDataset(tmp_path / "d")
    open(tmp_path / "d.idx", "wb").write(good)
    _patch(tmp_path / "d.idx", 17, b"\x09")
    with pytest.raises(ValueError, match="dtype code 9"):
        IndexedDataset(tmp_path / "d")
    open(tmp_path / "d.idx", "wb").write(good[:-3])
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(tmp_path / "d")


def test_bin_size_mismatch_names_both_files(tmp_path):
    reference_write(tmp_path / "d", np.uint16, [[[1, 2, 3]]])
    with open(tmp_path / "d.bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(ValueError) as e:
        IndexedDataset(tmp_path / "d")
    assert "d.bin" in str(e.value) and "d.idx" in str(e.value)
