"""The real commands: python tools/preprocess_data.py and tools/merge_datasets.py from the repo root."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from megatrain.data.indexed_dataset import IndexedDataset

REPO = Path(__file__).resolve().parents[2]


def run(*args):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_preprocess_and_merge_commands(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{i} {i + 1}"}) + "\n" for i in range(20)))
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    res = run("tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(tmp_path / "a" / "c"),
              "--workers", "2", "--append-eod", *null)
    assert res.returncode == 0, res.stderr
    assert "Processed 20 documents" in res.stdout
    ds = IndexedDataset(tmp_path / "a" / "c_text_document")
    assert ds.dtype == np.uint16 and len(ds) == 20 and ds[3].tolist() == [3, 4, 100]

    res = run("tools/merge_datasets.py", "--input", str(tmp_path / "a" / "c_text_document"),
              str(tmp_path / "a" / "c_text_document"), "--output-prefix", str(tmp_path / "m"))
    assert res.returncode == 0, res.stderr
    assert len(IndexedDataset(tmp_path / "m")) == 40

    corpus.write_text('{"text": "1"}\n{"text": \n')
    res = run("tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(tmp_path / "b"), *null)
    assert res.returncode == 1
    assert f"{corpus}:2: invalid JSON" in res.stderr and "Traceback" not in res.stderr
    assert not list(tmp_path.glob("b_*"))
