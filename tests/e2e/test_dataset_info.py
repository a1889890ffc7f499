"""tools/dataset_info.py as a command: summary and the first training samples in order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from megatrain.data.config import DataConfig
from megatrain.data.gpt_dataset import build_train_valid_test_datasets
from megatrain.data.indexed_dataset import IndexedDatasetWriter

ROOT = Path(__file__).resolve().parents[2]


def test_summary_and_dump(tmp_path):
    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "corpus_text_document")
    w = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(300):
        w.add_document(rng.integers(0, 1000, size=int(rng.integers(1, 60))))
    w.finalize()
    out = tmp_path / "samples.npy"
    cmd = [sys.executable, str(ROOT / "tools" / "dataset_info.py"), "--data-path", prefix,
           "--split", "90,9,1", "--seq-length", "32", "--seed", "77", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--train-iters", "20", "--eval-interval", "10",
           "--eval-iters", "2", "--dump-samples", "12", "--output", str(out),
           "--data-cache-path", str(tmp_path / "cache")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "documents: 300" in res.stdout and "dtype: uint16" in res.stdout
    assert "train 80, valid 24, test 8" in res.stdout
    got = np.load(out)
    assert got.dtype == np.int64 and got.shape == (12, 33)
    train = build_train_valid_test_datasets(DataConfig(data_path=[prefix], split="90,9,1"), 32, 77,
                                            (80, 24, 8))[0]
    np.testing.assert_array_equal(got, np.stack([train[i] for i in range(12)]))
    assert not list(tmp_path.glob("samples.npy.*"))

    bad = subprocess.run(cmd[:2] + ["--data-path", str(tmp_path / "nope"), "--seq-length", "8"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--data-path" in bad.stderr and "nope" in bad.stderr
