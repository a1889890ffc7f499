"""Small helpers shared by the benchmark scripts."""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]

RESULT_PREFIX = "RESULT "


def print_worker_result(result: dict[str, Any]) -> None:
    """A worker process's answer: one line the parent picks out of its output."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_worker(cmd: list[str], cwd: Path, name: str, timeout: int) -> dict[str, Any]:
    """Run a benchmark row in its own process (``cmd``, which ends with :func:`print_worker_result`);
    its result, or ``{"row": name, "error": ...}`` when it fails or runs past ``timeout`` seconds."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"row": name, "error": f"timed out after {timeout} s (--timeout)"}
    result = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
    if proc.returncode or not result:
        return {"row": name, "error": (proc.stdout + proc.stderr)[-2000:] or f"exit {proc.returncode}"}
    return json.loads(result[-1][len(RESULT_PREFIX):])


def emit_table(lines: list[str], output: str | None) -> None:
    """Print a benchmark's markdown table and, with ``output``, also write it to that file."""
    table = "\n".join(lines)
    print("\n" + table, flush=True)
    if output:
        Path(output).write_text(table + "\n", encoding="utf-8")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or what platform knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def glue_flag_values(argv: list[str], flag: str = "--extra") -> list[str]:
    """``[flag, value]`` pairs as ``flag=value``, so that a value starting with "--" (extra flags
    for pretrain_gpt.py, e.g. ``--extra "--use-distributed-optimizer"``) is not read as an option."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == flag and i + 1 < len(argv):
            out.append(f"{flag}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def timed_hf_steps(step_model: Any, model: Any, opt: Any, batches: list[dict[str, Any]], iters: int, warmup: int,
                   cuda: bool) -> tuple[float, float, float]:
    """``iters`` training steps of a transformers model (``step_model``: it or its compiled form; bf16
    autocast on CUDA, gradient clipping at 1.0, ``opt``) cycling through ``batches``: the median step
    time in ms after ``warmup`` steps, the peak CUDA memory in GiB (0 on CPU) and the last step's loss."""
    import torch

    times, peak = [], 0.0
    for i in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            loss = step_model(**batches[i % len(batches)]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() / 2**30)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, peak, float(loss)


def versions() -> str:
    """Python, torch and transformers versions, the platform, the host and the git commit (dirty or not)."""
    import torch

    try:
        import transformers
        tv = transformers.__version__
    except ImportError:
        tv = "not installed"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        commit += " (+ uncommitted changes)" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return (f"Python {platform.python_version()}, torch {torch.__version__}, transformers {tv}, "
            f"{platform.platform()}, {platform.node()}, commit {commit}")


def num(x: float) -> str:
    """TFLOP/s to one decimal, small (CPU) rates to three significant digits."""
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def last_error_line(row: dict[str, Any]) -> str:
    """The last non-empty line of a failed row's ``error`` (200 characters at most), for its table cell."""
    last = [x for x in row["error"].splitlines() if x.strip()]
    return last[-1][:200] if last else ""


def rate_cells(row: dict[str, Any], flops: float, peak: float | None, device: str) -> tuple[float, str, str]:
    """A row's TFLOP/s (``flops`` per iteration over its ms/iter), its share of the matmul rate ``peak``
    ("-" without one) and its peak GiB ("-" on the CPU)."""
    tflops = flops / (row["ms/iter"] / 1e3) / 1e12
    frac = f"{tflops / peak:.2f}" if peak else "-"
    mem = f"{row.get('peak GiB', 0.0):.1f}" if device != "cpu" else "-"
    return tflops, frac, mem
