"""Context parallelism's sequence layout: load-balanced chunks, the batch split, and the flag checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain.data.batch import CausalLMBatch
from megatrain.parallel.context_parallel import chunk_positions, split_batch
from megatrain.training.arguments import parse_args


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_chunks_cover_the_sequence_once_with_balanced_work(cp):
    seq = 32
    parts = [chunk_positions(seq, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(seq))
    # Causal attention work of a query at position p is p + 1 keys: equal for every rank.
    work = [int((p + 1).sum()) for p in parts]
    assert len(set(work)) == 1
    if cp == 2:
        assert chunk_positions(seq, 2, 0).tolist() == [*range(0, 8), *range(24, 32)]


def test_split_batch_keeps_global_positions():
    tokens = torch.arange(2 * 16).view(2, 16)
    batch = CausalLMBatch(tokens, tokens + 1, torch.ones(2, 16))
    part = split_batch(batch, 2, 1)
    assert part.tokens[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert part.position_ids[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(part.labels, part.tokens + 1)
    with pytest.raises(ValueError, match="--reset-attention-mask"):
        split_batch(dataclasses.replace(batch, attention_mask=torch.ones(2, 1, 16, 16, dtype=torch.bool)), 2, 0)
    with pytest.raises(ValueError, match="divisible by 2 x --context-parallel-size"):
        chunk_positions(12, 4, 0)


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "2",
        "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--device", "cpu"]


@pytest.mark.parametrize("extra, message", [
    (["--seq-length", "12"], "must be divisible by 8"),
    (["--seq-length", "16", "--reset-attention-mask"], "--reset-attention-mask"),
])
def test_context_parallel_flag_checks(monkeypatch, extra, message):
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(SystemExit, match=message):
        parse_args([*BASE, "--context-parallel-size", "4", *extra])
