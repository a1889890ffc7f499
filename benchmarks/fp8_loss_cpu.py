"""fp8 loss curves on a CPU (or a GPU): ``pretrain_gpt.py`` runs with ``torch._scaled_mm`` emulated in float32
(each fp8 operand times its inverse scale, then one float32 matmul), so the fp8 casts, scales and
amax histories are megatrain's own and only the tensor cores' accumulation differs. Each row is one
run of the GPU loss-curve test's shape (tests/e2e/test_fast_path_parity.py: GPT 4 x 256, mock data,
bf16) against the bf16 eager run: the worst step's relative difference, the last 10 steps' mean's,
and the mean signed difference (> 0: the fp8 run's loss is higher).

    python benchmarks/fp8_loss_cpu.py                      # 100 steps: tensorwise, delayed, delayed compiled
    python benchmarks/fp8_loss_cpu.py --iters 30 --rows tensorwise --output fp8_cpu.md
    python benchmarks/fp8_loss_cpu.py --device cuda --seed 7    # the same comparison with the GPU's fp8 matmuls

(A 100-step row takes ~2-4 minutes on two cores; ``--use-torch-compile`` rows compile first.)
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import torch

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit_table, versions  # noqa: E402

DELAYED = ["--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max"]
ROWS = {
    "tensorwise": ["--fp8-format", "hybrid", "--no-torch-compile"],
    "tensorwise-compiled": ["--fp8-format", "hybrid", "--use-torch-compile"],
    "delayed": ["--fp8-format", "hybrid", *DELAYED, "--no-torch-compile"],
    "delayed-compiled": ["--fp8-format", "hybrid", *DELAYED, "--use-torch-compile"],
}
REFERENCE = ["--no-torch-compile", "--cross-entropy-chunk-size", "0", "--no-gradient-accumulation-fusion"]


def _emulated_scaled_mm(a, b, scale_a=None, scale_b=None, bias=None, scale_result=None, out_dtype=None,
                        use_fast_accum=False, out=None):
    r = (a.float() * scale_a.float()) @ (b.float() * scale_b.float())
    if bias is not None:
        r = r + bias.float()
    r = r.to(out_dtype or torch.float32)
    return out.copy_(r) if out is not None else r


def run_emulated(argv: list[str]) -> None:
    """``pretrain_gpt.py argv`` in this process, its fp8 matmuls emulated."""
    torch._scaled_mm = _emulated_scaled_mm
    sys.argv = ["pretrain_gpt.py", *argv]
    sys.path.insert(0, str(_REPO))
    runpy.run_path(str(_REPO / "pretrain_gpt.py"), run_name="__main__")


def _flags(iters: int, device: str, seed: int) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
            "--max-position-embeddings", "256", "--micro-batch-size", "4", "--global-batch-size", "16",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "8000", "--eval-iters", "0", "--device", device,
            "--seed", str(seed),
            "--train-iters", str(iters), "--lr", "1e-3", "--lr-warmup-iters", str(min(10, iters // 2)),
            "--lr-decay-iters", str(iters), "--log-interval", "1", "--bf16", "--clip-grad", "1.0"]


def losses(extra: list[str], iters: int, timeout: int, device: str = "cpu", seed: int = 1234) -> list[float]:
    """The run's per-iteration lm loss; on the CPU with the fp8 matmuls emulated, on CUDA as they are."""
    flags = [*_flags(iters, device, seed), *extra]
    cmd = ([sys.executable, __file__, "--run-emulated", "--", *flags] if device == "cpu"
           else [sys.executable, "pretrain_gpt.py", *flags])
    env = {**os.environ, "MEGATRAIN_FP8_BACKEND": "fused"}
    proc = subprocess.run(cmd, cwd=_REPO, capture_output=True, text=True, timeout=timeout, env=env)
    found = [float(m.group(1)) for m in re.finditer(r"\] iteration .*?lm loss: ([0-9.E+-]+)", proc.stdout)]
    if proc.returncode or len(found) != iters:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise RuntimeError(f"exit {proc.returncode}, {len(found)} of {iters} iterations: " + " | ".join(tail))
    return found


def compare(reference: list[float], run: list[float]) -> tuple[float, int, float, float]:
    """(worst relative difference, its step (1-based), last-10 means' relative difference, mean signed)."""
    rel = [abs(r - e) / abs(e) for e, r in zip(reference, run)]
    worst = max(rel)
    k = min(10, len(run))
    tail_e, tail_r = sum(reference[-k:]) / k, sum(run[-k:]) / k
    signed = sum((r - e) / e for e, r in zip(reference, run)) / len(run)
    return worst, rel.index(worst) + 1, abs(tail_r - tail_e) / tail_e, signed


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-emulated"]:
        run_emulated(argv[2:] if argv[1:2] == ["--"] else argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--rows", default="tensorwise,delayed,delayed-compiled",
                   help=f"comma-separated, of: {', '.join(ROWS)}")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: fp8 matmuls emulated in float32; cuda: the GPU's own")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--output", default=None)
    a = p.parse_args(argv)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        p.error(f"--rows: unknown {unknown or 'nothing'}; choose from {', '.join(ROWS)}")
    if a.iters < 2:
        p.error("--iters must be at least 2")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    try:
        reference = losses(REFERENCE, a.iters, a.timeout, a.device, a.seed)
        how = "emulated in float32 on the CPU" if a.device == "cpu" else f"on {torch.cuda.get_device_name()}"
        lines = [f"fp8 loss curves, the fp8 matmuls {how} ({a.iters} steps, GPT 4 x 256, mock data, bf16, seed "
                 f"{a.seed}; against the bf16 eager run, final loss {reference[-1]:.4f}); {versions()}", "",
                 "| row | worst step | at step | last-10 mean | mean signed | final loss |", "|---|---:|---:|---:|---:|---:|"]
        for row in rows:
            run = losses(ROWS[row], a.iters, a.timeout, a.device, a.seed)
            worst, step, tail, signed = compare(reference, run)
            lines.append(f"| {row} | {worst:.2%} | {step} | {tail:.2%} | {signed:+.2%} | {run[-1]:.4f} |")
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        sys.exit(f"error: fp8_loss_cpu.py: a run failed: {e}")
    emit_table(lines, a.output)


if __name__ == "__main__":
    main()
