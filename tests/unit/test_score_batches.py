"""The server's scoring call runs its sequences as right-padded batches: the same log-probabilities
and top tokens as one forward per sequence, whatever the batch split."""

from __future__ import annotations

import pytest
import torch

from megatrain.inference import model_calls
from tests.unit.test_server import tiny_model


def one_by_one(model, sequences, top_n):
    out = []
    with torch.no_grad():
        for seq in sequences:
            logp = model(torch.tensor([seq[:-1]]))[0].float().log_softmax(-1)
            picked = logp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].tolist()
            values, ids = logp[:, :30].topk(top_n, dim=-1)
            out.append((picked, ids.tolist(), values.tolist()))
    return out


@pytest.mark.parametrize("budget", [8, 40, 16384])  # every sequence alone, a few per batch, one batch
def test_padded_batches_equal_one_forward_per_sequence(monkeypatch, budget):
    monkeypatch.setattr(model_calls, "SCORE_BATCH_TOKENS", budget)
    model = tiny_model()
    sequences = [[1, 2, 3, 4, 5, 6, 7], [9], [4, 5], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3, 3, 3], []]
    got = model_calls.score(model, {"sequences": sequences, "top_n": 2, "vocab_size": 30})
    assert got[1] == {"logprobs": [], "top": []} and got[5] == {"logprobs": [], "top": []}
    for seq, result, (picked, ids, values) in zip(sequences, got, one_by_one(model, [s if len(s) >= 2 else [0, 0] for s in sequences], 2)):
        if len(seq) < 2:
            continue
        assert result["logprobs"] == pytest.approx(picked, abs=1e-5)
        assert [[i for i, _ in row] for row in result["top"]] == ids
        assert [v for row in result["top"] for _, v in row] == pytest.approx([v for row in values for v in row], abs=1e-5)
