"""benchmarks/t5_attention.py's smoke run on CPU: the SDPA variants of T5's encoder attention on a tiny shape,
one table row each, and every variant with the trained bias giving the same bias gradient (the same maths,
only where the mask is built and how its gradient is summed differ)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# ~9 s alone, ~32 s beside another worker (six variants, each compiled): a benchmark's tool, like the fp8 loss-curve
# and throughput tables' tests; the bias gradient's maths is tests/unit/test_bias_gradient.py's
@pytest.mark.long
def test_tiny_cpu_run_prints_a_row_per_variant(tmp_path):
    out = tmp_path / "t5_attention.md"
    variants = ["sdpa-bias", "sdpa-bias-shared", "sdpa-bias-per-layer", "sdpa-bias-tap", "sdpa-bias-frozen", "sdpa-pad"]
    proc = subprocess.run([sys.executable, "benchmarks/t5_attention.py", "--shape", "tiny", "--device", "cpu",
                           "--iters", "1", "--warmup", "1", "--output", str(out), "--variants", *variants],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip().strip("|").split("|")]
                                          for line in out.read_text().splitlines()[4:])}
    assert list(rows) == variants and not any("failed" in r[1] for r in rows.values()), rows
    trained = {rows[v][4] for v in ("sdpa-bias", "sdpa-bias-shared", "sdpa-bias-per-layer", "sdpa-bias-tap")}
    assert len(trained) == 1 and trained != {"-"}, rows
    assert rows["sdpa-bias-frozen"][4] == rows["sdpa-pad"][4] == "-"
