"""benchmarks/compile_report: a process started with the folder on PYTHONPATH and COMPILE_REPORT set
appends one line per compiled frame (forward, then its backward) at exit; without COMPILE_REPORT it
writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = ("import torch\n"
          "def double_sin(x):\n"
          "    return (x.sin() * 2).sum()\n"
          "x = torch.randn(8, requires_grad=True)\n"
          "torch.compile(double_sin, backend='aot_eager')(x).backward()\n")


def _run(tmp_path: Path, report: Path | None) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "benchmarks" / "compile_report")}
    env.pop("COMPILE_REPORT", None)
    if report is not None:
        env["COMPILE_REPORT"] = str(report)
    subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, check=True, timeout=300)


@pytest.mark.long  # ~20 s (two compiling processes): a benchmark's tool, used by the device rounds
def test_each_compiled_frame_is_a_line_with_its_times(tmp_path):
    report = tmp_path / "report.txt"
    _run(tmp_path, report)
    _run(tmp_path, report)  # a second process appends
    text = report.read_text()
    assert text.count("# compiled frames: 1 (2 lines") == 2, text
    frames = [line for line in text.splitlines() if "double_sin" in line and "<string>" in line]
    assert len(frames) == 2, text
    assert " s wall | frame " in frames[0] and " aot " in frames[0] and " inductor " in frames[0], frames[0]
    assert all("FAILED" not in line for line in text.splitlines()), text


def test_nothing_is_written_without_the_variable(tmp_path):
    _run(tmp_path, None)
    assert list(tmp_path.iterdir()) == []
