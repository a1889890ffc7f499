"""Speed does not change the maths: `pretrain_gpt.py` with the chunked output-layer cross entropy logs
the same per-iteration losses and gradient norms as the plain path on the same data (fp32: to the
printed digits; bf16 autocast: within bf16 tolerance)."""

from __future__ import annotations

import sys

import pytest

from megatrain.training.logging import parse_train_log_line
from tests.e2e.conftest import run_cmd

ITERS = 30
RUN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
       "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
       "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--mock-data",
       "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--eval-iters", "0", "--device", "cpu",
       "--train-iters", str(ITERS), "--lr", "3e-3", "--lr-warmup-iters", "3", "--log-interval", "1",
       "--no-torch-compile"]


def _losses(*extra: str) -> list[tuple[float, float]]:
    out = run_cmd([sys.executable, "pretrain_gpt.py", *RUN, *extra]).stdout
    lines = [parse_train_log_line(line) for line in out.splitlines() if "] iteration " in line]
    assert [d["iteration"] for d in lines] == list(range(1, ITERS + 1))
    return [(d["lm loss"], d["grad norm"]) for d in lines]


@pytest.mark.parametrize("precision,tolerance", [([], 2e-6), pytest.param(["--bf16"], 2e-2, marks=pytest.mark.slow)],
                         ids=["fp32", "bf16"])
def test_chunked_cross_entropy_trains_like_the_plain_head(precision, tolerance):
    plain = _losses(*precision, "--cross-entropy-chunk-size", "0")
    chunked = _losses(*precision, "--cross-entropy-chunk-size", "48")  # 256 tokens per micro-batch: 6 chunks
    assert plain[-1][0] < plain[0][0] - 0.3, "the run should learn, or the comparison says little"
    for step, ((lp, gp), (lc, gc)) in enumerate(zip(plain, chunked), start=1):
        assert abs(lc - lp) <= tolerance * abs(lp), (step, lp, lc)
        assert abs(gc - gp) <= max(tolerance * 10, 1e-3) * abs(gp), (step, gp, gc)  # norms print 3 decimals
