"""Crafted ``.idx`` files: an index whose entries disagree is refused when opened, with one line.

Each case starts from a valid pair written by the real writer and edits index entries so that the
header, the file sizes and the ``.bin`` size all still agree (the checks that existed before): only
the whole-index validation can notice. Every case is refused by the library with one line naming
the file and the first offending entry, and by a real command (``tools/dataset_info.py``,
``tools/merge_datasets.py``, ``pretrain_gpt.py``) with that one line on stderr and no traceback.
Valid files of every shape the writers produce still load.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatrain.data.indexed_dataset import HEADER_SIZE, IndexedDataset, IndexedDatasetWriter

REPO = Path(__file__).resolve().parents[2]

# Three documents of 3, 2 and 4 tokens, written as uint16 (bytes: 6, 4, 8 -> pointers 0, 6, 10).
DOCS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


def write(prefix: Path, docs=DOCS, dtype=np.uint16) -> str:
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


def entries(prefix: str, n_seq: int, n_doc: int):
    """Writable views of (lengths, pointers, document boundaries) of ``prefix.idx``."""
    idx = f"{prefix}.idx"
    lengths = np.memmap(idx, dtype="<i4", mode="r+", offset=HEADER_SIZE, shape=(n_seq,))
    pointers = np.memmap(idx, dtype="<i8", mode="r+", offset=HEADER_SIZE + 4 * n_seq, shape=(n_seq,))
    docs = np.memmap(idx, dtype="<i8", mode="r+", offset=HEADER_SIZE + 12 * n_seq, shape=(n_doc,))
    return lengths, pointers, docs


def swap_lengths(prefix):
    """Lengths 3, 2 -> 2, 3 with the pointers unchanged: the total size still matches."""
    lengths, _, _ = entries(prefix, 3, 4)
    lengths[0], lengths[1] = 2, 3
    lengths.flush()


def first_pointer_not_zero(prefix):
    """Sequence 0 starts at byte 2 with 2 tokens: it still ends where sequence 1 starts."""
    lengths, pointers, _ = entries(prefix, 3, 4)
    lengths[0], pointers[0] = 2, 2
    lengths.flush()
    pointers.flush()


def negative_length(prefix):
    """Lengths 3, -1, 5 with pointers 0, 6, 4 chain consistently and end at byte 14."""
    lengths, pointers, _ = entries(prefix, 3, 4)
    lengths[1], lengths[2], pointers[2] = -1, 5, 4
    lengths.flush()
    pointers.flush()
    with open(f"{prefix}.bin", "r+b") as f:
        f.truncate(14)


def documents_not_ending_at_s(prefix):
    """The last boundary says 2 of the 3 sequences: sequence 2 belongs to no document."""
    _, _, docs = entries(prefix, 3, 4)
    docs[3] = 2
    docs.flush()


def documents_decreasing(prefix):
    """Boundaries 0, 2, 1, 3: the second document would have -1 sequences."""
    _, _, docs = entries(prefix, 3, 4)
    docs[1], docs[2] = 2, 1
    docs.flush()


def documents_not_starting_at_0(prefix):
    _, _, docs = entries(prefix, 3, 4)
    docs[0] = 1
    docs.flush()


CASES = {
    "lengths_disagree_with_pointers": (swap_lengths, r"sequence 1 starts at byte 6 but sequence 0 \(at byte 0, "
                                                     r"2 tokens of uint16\) ends at byte 4"),
    "first_pointer_not_zero": (first_pointer_not_zero, r"sequence 0 starts at byte 2 of the \.bin, expected 0"),
    "negative_length": (negative_length, r"sequence 1 has negative length -1"),
    "documents_not_ending_at_s": (documents_not_ending_at_s, r"last document boundary \(3\) is 2 but the index "
                                                             r"has 3 sequences"),
    "documents_decreasing": (documents_decreasing, r"document boundary 2 is 1, below boundary 1 \(2\)"),
    "documents_not_starting_at_0": (documents_not_starting_at_0, r"document boundary 0 is 1, expected 0"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_library_refuses_with_one_line(tmp_path, case):
    craft, message = CASES[case]
    prefix = write(tmp_path / "d")
    craft(prefix)
    with pytest.raises(ValueError, match=message) as e:
        IndexedDataset(prefix)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{prefix}.idx: corrupt index: ")


def commands(prefix: str, out: Path) -> dict[str, list[str]]:
    return {
        "dataset_info": ["tools/dataset_info.py", "--data-path", prefix, "--seq-length", "4"],
        "merge_datasets": ["tools/merge_datasets.py", "--input", prefix, "--output-prefix", str(out / "merged")],
        "pretrain_gpt": ["pretrain_gpt.py", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads",
                         "2", "--seq-length", "4", "--max-position-embeddings", "4", "--micro-batch-size", "1",
                         "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--tokenizer-type",
                         "NullTokenizer", "--vocab-size", "16", "--data-path", prefix, "--split", "1,0,0"],
    }


# Every case through the fast commands; pretrain_gpt.py (a torch start-up) on two of them.
COMMAND_CASES = [(case, cmd) for case in CASES for cmd in ("dataset_info", "merge_datasets")]
COMMAND_CASES += [("lengths_disagree_with_pointers", "pretrain_gpt"), ("documents_decreasing", "pretrain_gpt")]


@pytest.mark.parametrize("case, command", COMMAND_CASES)
def test_commands_refuse_with_one_line(tmp_path, case, command):
    craft, message = CASES[case]
    prefix = write(tmp_path / "corpus_text_document")
    craft(prefix)
    argv = commands(prefix, tmp_path)[command]
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: ") and f"{prefix}.idx: corrupt index: " in lines[0], lines[0]
    assert re.search(message, lines[0]), lines[0]
    assert not list(tmp_path.glob("merged*")), "nothing is written from a refused input"


def valid_shapes(tmp_path: Path) -> dict[str, tuple[str, list[list[int]], list[int]]]:
    """(prefix, sequences, document boundaries) of files the writers produce, all valid."""
    out = {}
    for dtype in (np.uint16, np.int32):
        name = f"plain_{np.dtype(dtype).name}"
        out[name] = (write(tmp_path / name, dtype=dtype), DOCS, [0, 1, 2, 3])
    # Sentence-split documents (several sequences each), an empty document (a repeated boundary)
    # and zero-length sequences, as Megatron-LM's --split-sentences preprocessing writes them.
    with IndexedDatasetWriter(tmp_path / "sentences", np.int32) as w:
        w.add_document([1, 2, 3, 4, 5], lengths=[2, 3])
        w.add_document([], lengths=[])
        w.add_document([])
        w.add_document([70000, 6], lengths=[0, 2, 0])
        w.add_item([7])
        w.add_item([])
        w.end_document()
    out["sentences"] = (str(tmp_path / "sentences"), [[1, 2], [3, 4, 5], [], [], [70000, 6], [], [7], []],
                        [0, 2, 2, 3, 6, 8])
    with IndexedDatasetWriter(tmp_path / "empty", np.uint16):
        pass
    out["empty"] = (str(tmp_path / "empty"), [], [0])
    return out


def test_valid_files_still_load(tmp_path):
    for name, (prefix, sequences, boundaries) in valid_shapes(tmp_path).items():
        ds = IndexedDataset(prefix)
        assert [s.tolist() for s in ds] == sequences, name
        assert ds.document_indices.tolist() == boundaries, name
    merged = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "tools/merge_datasets.py", "--input", str(tmp_path / "sentences"),
                           str(tmp_path / "sentences"), "--output-prefix", str(merged)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert len(IndexedDataset(merged)) == 16
