"""Blending order against a plain-loop transcription of Megatron's build_blending_indices."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from megatrain.data.blended_dataset import BlendedDataset, build_blending_indices, normalize_weights
from megatrain.data.config import DataConfig
from megatrain.data.gpt_dataset import build_train_valid_test_datasets
from megatrain.data.indexed_dataset import IndexedDatasetWriter


def ref_blending(weights, size):
    counts = [0] * len(weights)
    dataset_index, sample_index = [], []
    for i in range(size):
        step = max(float(i), 1.0)
        best, best_err = 0, weights[0] * step - counts[0]
        for d in range(1, len(weights)):
            err = weights[d] * step - counts[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index.append(best)
        sample_index.append(counts[best])
        counts[best] += 1
    return dataset_index, sample_index


@pytest.mark.parametrize("weights,size", [
    ([0.3, 0.7], 5000), ([1, 1, 1], 20000), ([0.5, 0.25, 0.25], 9000),
    ([0.7, 0.001, 0.299], 30000), ([5, 1, 3, 2, 8, 0.01], 25000), ([1] * 10, 7000), ([2.0], 100),
])
def test_matches_reference(weights, size):
    w = normalize_weights(weights)
    di, dsi = build_blending_indices(w, size)
    ref_d, ref_s = ref_blending(w, size)
    assert di.dtype == np.int16 and dsi.dtype == np.int64
    np.testing.assert_array_equal(di, ref_d)
    np.testing.assert_array_equal(dsi, ref_s)


def test_random_weights_match_reference():
    rng = np.random.default_rng(11)
    for _ in range(8):
        k = int(rng.integers(2, 7))
        w = normalize_weights((rng.random(k) ** 3 + 1e-3).tolist())
        size = int(rng.integers(1, 15000))
        di, dsi = build_blending_indices(w, size)
        ref_d, ref_s = ref_blending(w, size)
        np.testing.assert_array_equal(di, ref_d)
        np.testing.assert_array_equal(dsi, ref_s)


def write(prefix, n_docs, seed):
    rng = np.random.default_rng(seed)
    w = IndexedDatasetWriter(str(prefix), np.uint16)
    for _ in range(n_docs):
        w.add_document(rng.integers(0, 500, size=int(rng.integers(1, 30))))
    w.finalize()
    return str(prefix)


def test_weighted_blend_through_the_builder(tmp_path):
    a, b = write(tmp_path / "a", 120, 1), write(tmp_path / "b", 60, 2)
    cache = str(tmp_path / "cache")
    cfg = DataConfig(data_path=["0.3", a, "0.7", b], split="90,10,0", data_cache_path=cache)
    n = 200
    train, valid, test = build_train_valid_test_datasets(cfg, 8, 1234, (n, 20, 4))
    assert test is None and isinstance(train, BlendedDataset)
    w = normalize_weights([0.3, 0.7])
    # each dataset is built with ceil(ceil(N*w)*1.005) samples; the blend has sum(ceil(N*w))
    assert [d.num_samples for d in train.datasets] == [math.ceil(math.ceil(n * x) * 1.005) for x in w]
    assert len(train) == sum(math.ceil(n * x) for x in w)
    ref_d, ref_s = ref_blending(normalize_weights(w), len(train))
    np.testing.assert_array_equal(train.dataset_index, ref_d)
    for i in (0, 1, 2, 50, len(train) - 1):
        np.testing.assert_array_equal(train[i], train.datasets[ref_d[i]][ref_s[i]])
    names = os.listdir(cache)
    assert any(x.endswith("-BlendedDataset-train-dataset_index.npy") for x in names)
    again = build_train_valid_test_datasets(cfg, 8, 1234, (n, 20, 4))[0]
    assert isinstance(again.dataset_index, np.memmap)
    np.testing.assert_array_equal(again.dataset_sample_index, train.dataset_sample_index)


def test_unweighted_prefixes_are_weighted_by_size(tmp_path):
    a, b = write(tmp_path / "a", 80, 3), write(tmp_path / "b", 40, 4)
    train = build_train_valid_test_datasets(DataConfig(data_path=[a, b], split="1,0,0"), 8, 7, (50, 0, 0))[0]
    lens = [len(d) for d in train.datasets]
    assert all(d.num_samples is None for d in train.datasets)  # one epoch each
    assert len(train) == min(50, sum(lens))
    ref_d, _ = ref_blending(normalize_weights(lens), len(train))
    np.testing.assert_array_equal(train.dataset_index, ref_d)
