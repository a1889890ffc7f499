"""benchmarks/vlm_speed.py's smoke run: a tiny LLaVA (2-layer CLIP ViT, 2-layer LLaMA-style LM) on CPU,
both rows (the real ``pretrain_vlm.py`` on a generated LLaVA jsonl with PNG images, and transformers'
``LlavaForConditionalGeneration`` uncompiled), printing the table with both rows and no error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| row ")]


@pytest.mark.slow
@pytest.mark.long  # ~17 s: a benchmark's tool (its device runs use it), like the throughput table's test
@pytest.mark.parametrize("stage", ["sft", "pretrain"])
def test_tiny_cpu_run_prints_both_rows(tmp_path, stage):
    pytest.importorskip("transformers")
    pytest.importorskip("PIL")
    out = tmp_path / "vlm_speed.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "benchmarks/vlm_speed.py", "--shape", "tiny", "--device", "cpu",
                           "--iters", "2", "--warmup", "1", "--no-compile", "--stage", stage, "--timeout", "120",
                           "--output", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text.strip() in proc.stdout
    assert f"stage {stage}" in text and "16 image tokens" in text and "sequence 64 positions" in text
    rows = _table_rows(text)
    assert [r[0].split(" (")[0] for r in rows] == ["megatrain pretrain_vlm.py",
                                                   "transformers LlavaForConditionalGeneration"], text
    for r in rows:
        assert len(r) == 7 and not r[1].startswith("error"), (r, proc.stderr[-3000:])
        ms, samples, tflops = float(r[1]), float(r[2]), float(r[3])
        assert ms > 0 and samples == pytest.approx(2 / ms * 1e3, rel=0.01) and tflops > 0
    assert rows[0][6] == "1.00" and float(rows[1][6]) > 0
    assert "not compiled" in rows[1][0] and f"({stage};" in rows[1][0]
