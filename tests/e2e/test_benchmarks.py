"""The benchmark scripts run end to end (tiny shape, CPU): the throughput table on mock and on real
preprocessed data, appended to a results file, and the step profiler's outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import run_cmd


@pytest.mark.long
def test_throughput_table_on_mock_and_real_data(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nearlier figures\n", encoding="utf-8")
    for data in ("mock", "real"):
        run_cmd([sys.executable, "benchmarks/throughput.py", "tiny", "--iters", "4", "--warmup", "1", "--data", data,
                 "--extra", "--device cpu", "--results", str(results), "--title", f"tiny {data}"], timeout=300)
    text = results.read_text(encoding="utf-8")
    assert text.startswith("# Results\n\nearlier figures\n")  # appended, nothing lost
    rows = [line for line in text.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 2 and "## tiny mock" in text and "## tiny real" in text and "commit" in text
    for row, data in zip(rows, ("mock", "real")):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == data and "failed" not in row
        assert float(cells[7].replace(",", "")) > 0  # tokens/s/GPU


def test_profile_step_writes_kernel_table_and_summary(tmp_path):
    run_cmd([sys.executable, "benchmarks/profile_step.py", "--shape", "tiny", "--device", "cpu", "--warmup", "1",
             "--steps", "1", "--out", str(tmp_path)], timeout=300)
    summary = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))
    assert summary and (tmp_path / "kernels.txt").read_text(encoding="utf-8").strip()


@pytest.mark.long  # ~12 s: a benchmark's tool; the one-process kernel table above stays in the default run
def test_profile_step_under_torchrun_reports_from_rank_0(tmp_path):
    run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "benchmarks/profile_step.py", "--shape", "tiny", "--device", "cpu", "--warmup", "1", "--steps", "1",
             "--out", str(tmp_path), "--extra", "--tensor-model-parallel-size 2 --sequence-parallel"], timeout=300)
    table = (tmp_path / "kernels.txt").read_text(encoding="utf-8")
    assert "rank 0 of 2" in table and "communication" in table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels.txt", "summary.json"]  # one writer


def test_idle_gaps_are_filed_under_the_kernel_that_ended_the_wait():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from profile_step import idle_gaps, render_gaps

    intervals = [(0.0, 10.0, "a", ""), (5.0, 20.0, "b", ""),  # overlapping: no gap
                 (23.0, 30.0, "c", ""),  # 3 us: below the 5 us floor
                 (50.0, 60.0, "d", ""),  # 20 us idle before d
                 (60.0, 61.0, "a", ""), (161.0, 170.0, "d", "")]  # 100 us idle before d
    rows = idle_gaps(intervals)
    assert rows == [{"name": "d", "launcher": "", "gaps": 2, "total_us": 120.0, "max_us": 100.0}]
    text = render_gaps(rows, steps=2, top=5)
    assert "0.06 ms/step in 1 gaps" in text and " d" in text
    # with the host operators that queued each kernel: one row per kernel and launcher
    launched = [(*i[:3], "aten::zero_ < aten::zeros" if i[0] == 161.0 else "aten::fill_") for i in intervals]
    rows = idle_gaps(launched)
    assert [(r["launcher"], r["total_us"]) for r in rows] == [("aten::zero_ < aten::zeros", 100.0), ("aten::fill_", 20.0)]
    assert "d  <- aten::zero_ < aten::zeros" in render_gaps(rows, steps=2, top=5)


def test_trace_kernels_table_of_a_chrome_trace(tmp_path):
    """benchmarks/trace_kernels.py on a written-out trace: per-iteration kernel times, categories, the
    busy time with overlapping streams counted once, the device's waits filed under the kernel that ended
    each and the host operators that queued it, and one clear line for a file that is no trace."""
    import gzip

    events = [{"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 0, "dur": 100},
              {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 150, "dur": 100,
               "args": {"correlation": 7}},
              {"ph": "X", "cat": "kernel", "name": "flash_fwd_kernel", "ts": 200, "dur": 100},  # overlaps the 2nd
              {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 390, "dur": 10,
               "args": {"correlation": 9}},
              # host (not counted as device time): the launches inside their operators, thread 1
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500, "tid": 1},
              {"ph": "X", "cat": "cpu_op", "name": "aten::zero_", "ts": 300, "dur": 50, "tid": 1},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 120, "dur": 5, "tid": 1,
               "args": {"correlation": 7}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemsetAsync", "ts": 320, "dur": 5, "tid": 1,
               "args": {"correlation": 9}}]
    trace = tmp_path / "trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    out = run_cmd([sys.executable, "benchmarks/trace_kernels.py", str(trace), "--iterations", "2", "--before",
                   "Memset"], timeout=60).stdout
    # --before: the memset, queued inside aten::zero_ < aten::mm, after the flash kernel on its stream (90 us later)
    assert "| 0.5 | 45.0 | 90.0 | aten::zero_ < aten::mm | `flash_fwd_kernel` |" in out, out
    assert "per iteration: span 0.20 ms, device busy 0.13 ms (65% of the span)" in out
    assert "| `sm90_xmma_gemm_bf16` | 1 | 0.100 | 64.5% | 100.0 |" in out
    assert "| matmul | 0.100 | 64.5% |" in out and "| attention | 0.050 | 32.3% |" in out
    # two waits over the two iterations: 50 us before the second matmul, 90 us before the memset
    assert "device idle (gaps of 5 us or more between kernels): 0.07 ms/step in 1 gaps" in out
    assert "Memset (Device)  <- aten::zero_ < aten::mm" in out and "sm90_xmma_gemm_bf16  <- aten::mm" in out
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    import subprocess

    proc = subprocess.run([sys.executable, "benchmarks/trace_kernels.py", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2 and "not a readable Chrome trace" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.long  # ~15 s alone, ~35 s beside another worker: a benchmark's tool, like the throughput table's test
def test_fp8_loss_curves_on_the_cpu(tmp_path):
    """benchmarks/fp8_loss_cpu.py: the fp8 runs (matmuls emulated in float32) against the bf16 eager run,
    one table row each; a row it does not know is one line."""
    out = tmp_path / "fp8.md"
    text = run_cmd([sys.executable, "benchmarks/fp8_loss_cpu.py", "--iters", "2", "--rows", "delayed",
                    "--output", str(out)], timeout=300).stdout
    row = [line for line in text.splitlines() if line.startswith("| delayed |")]
    assert len(row) == 1 and out.read_text().count("| delayed |") == 1
    worst = float(row[0].split("|")[2].strip().rstrip("%"))
    assert 0.0 <= worst < 1.0  # two steps of fp8 against bf16: close, and measured (not a placeholder)
    import subprocess

    proc = subprocess.run([sys.executable, "benchmarks/fp8_loss_cpu.py", "--rows", "fp4"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "--rows: unknown ['fp4']" in proc.stderr and "Traceback" not in proc.stderr
