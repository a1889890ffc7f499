"""Golden-loss gate: a deterministic tiny run must reproduce the committed per-step losses.

Any change to the model, initialisation, data order, optimizer, schedule or loss shows up here.
If a change is meant to alter the numbers, regenerate the file and say why in the commit:

    MEGATRAIN_UPDATE_GOLDEN=1 python -m pytest tests/e2e/test_golden_loss.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from megatrain.training.logging import parse_train_log_line
from tests.e2e.conftest import run_cmd

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tiny_gpt_losses.json"
RUNS = {
    "gpt2": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"],
    "llama": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
              "--num-query-groups", "2", "--swiglu", "--position-embedding-type", "rope", "--normalization",
              "RMSNorm", "--untie-embeddings-and-output-weights", "--disable-bias-linear"],
}
COMMON = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "10",
          "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--mock-data",
          "--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--log-interval", "1", "--eval-iters", "0",
          "--num-workers", "0", "--device", "cpu", "--seed", "1234"]


def losses(name: str) -> list[float]:
    proc = run_cmd([sys.executable, "pretrain_gpt.py", *RUNS[name], *COMMON])
    return [parse_train_log_line(l)["lm loss"] for l in proc.stdout.splitlines() if "] iteration " in l]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_losses_match_the_golden_file(name):
    got = losses(name)
    assert len(got) == 10
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("MEGATRAIN_UPDATE_GOLDEN"):
        golden[name] = got
        tmp = GOLDEN.with_suffix(".tmp")
        tmp.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, GOLDEN)
        pytest.skip("golden file updated")
    assert name in golden, f"no golden losses for {name}: run with MEGATRAIN_UPDATE_GOLDEN=1"
    # The log prints 7 significant digits; allow one unit in the last place of that print.
    assert got == pytest.approx(golden[name], rel=2e-6), (got, golden[name])
