"""Training throughput through the real `pretrain_gpt.py`: a table of TFLOP/s/GPU, MFU, tokens/s,
peak memory and time to the first iteration for the shapes we are measured by.

    python benchmarks/throughput.py                    # every shape
    python benchmarks/throughput.py gpt2-124m 1.7b     # some of them
    python benchmarks/throughput.py --output results.md --iters 30 --extra "--no-torch-compile"

Each run is a separate `pretrain_gpt.py` process, bf16, with `--log-interval 1`; TFLOP/s/GPU is
the median over the iterations after the warm-up, read from Megatron's log line (guide §3.4's
formula). Several GPUs: `--nproc N` launches torchrun.

Data: `--data mock` (default) trains on `--mock-data`; `--data real` first writes a preprocessed
dataset (`.bin/.idx` as `tools/preprocess_data.py` writes them: documents of random length and
random tokens, each ending with the end-of-document token) and trains on it through `--data-path`,
so the indexed dataset, the sample index and the pinned-memory loader are timed too.

Columns: MFU against the device's datasheet peak (from the log line) and against the bf16 matmul
peak measured on this GPU at start-up (`--matmul-peak` to give it instead). `--results FILE`
appends the table, under a heading with date, GPU, torch version and git commit, to FILE (e.g.
`benchmarks/RESULTS.md`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import glue_flag_values  # noqa: E402
from megatrain.atomic_io import atomic_write_text  # noqa: E402
from megatrain.training.logging import parse_train_log_line  # noqa: E402

# name -> pretrain_gpt.py flags (model shape and batch); the vocabulary comes from NullTokenizer.
SHAPES: dict[str, list[str]] = {
    "tiny": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 4 "
            "--global-batch-size 8 --vocab-size 511".split(),  # a smoke test that runs anywhere
    "gpt2-124m": "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 "
                 "--max-position-embeddings 1024 --micro-batch-size 16 --global-batch-size 64 "
                 "--vocab-size 50256".split(),
    "1.7b": "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 "
            "--max-position-embeddings 4096 --micro-batch-size 2 --global-batch-size 8 "
            "--vocab-size 131071".split(),
    "llama-1.2b": "--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention "
                  "--num-query-groups 8 --swiglu --ffn-hidden-size 8192 --position-embedding-type rope "
                  "--normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear "
                  "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 2 --global-batch-size 8 "
                  "--vocab-size 128255".split(),
    # Mixtral-style mixture of experts that fits one GPU: LLaMA-1.2B's attention, 8 SwiGLU experts of
    # 5632, top-2, Megatron's Mixtral example MoE flags (benchmarks/moe_speed.py compares it).
    "mixtral-moe": "--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention "
                   "--num-query-groups 8 --swiglu --ffn-hidden-size 5632 --position-embedding-type rope "
                   "--normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear "
                   "--rotary-base 1000000 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 5632 "
                   "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm "
                   "--moe-token-dispatcher-type alltoall "
                   "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 2 --global-batch-size 2 "
                   "--vocab-size 128255".split(),
}

COMMON = ("--tokenizer-type NullTokenizer --bf16 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine "
          "--lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 "
          "--log-interval 1 --eval-iters 0 --eval-interval 100000 --num-workers 2").split()


def _flag(flags: list[str], name: str) -> int:
    return int(flags[flags.index(name) + 1])


def make_real_dataset(folder: Path, shape_flags: list[str], iters: int, nproc: int, seed: int = 0) -> str:
    """A preprocessed dataset big enough for ``iters`` global batches of the shape; returns its prefix."""
    import numpy as np

    from megatrain.data.indexed_dataset import IndexedDatasetWriter, best_dtype

    vocab = _flag(shape_flags, "--vocab-size")  # NullTokenizer: ids 0..vocab-1, eod = vocab
    seq = _flag(shape_flags, "--seq-length")
    batch = _flag(shape_flags, "--global-batch-size")
    tokens = (iters + 2) * batch * (seq + 1) * 2  # the train split and some slack
    prefix = folder / f"bench_v{vocab}_s{seq}_text_document"
    rng = np.random.default_rng(seed)
    written = 0
    with IndexedDatasetWriter(prefix, best_dtype(vocab + 1)) as w:
        while written < tokens:
            n = int(rng.integers(64, 4 * seq))
            w.add_document(np.append(rng.integers(0, vocab, n - 1), vocab))
            written += n
    return str(prefix)


def measure_matmul_peak(size: int = 8192, repeats: int = 20) -> float | None:
    """Best bf16 matmul TFLOP/s of this GPU (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return 2 * size**3 / best / 1e12


def run_one(name: str, iters: int, warmup: int, extra: list[str], nproc: int, timeout: int,
            data_path: str | None = None, matmul_peak: float | None = None) -> dict:
    data = ["--data-path", data_path, "--split", "100,0,0"] if data_path else ["--mock-data"]
    env = dict(os.environ)
    settings = []  # leading NAME=VALUE words of an --extra: environment settings of that run, as in a shell
    while extra and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", extra[0]):
        settings.append(extra[0])
        extra = extra[1:]
    env.update(item.split("=", 1) for item in settings)
    flags = [*SHAPES[name], *COMMON, *data, "--train-iters", str(iters), *extra]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "pretrain_gpt.py", *flags]
    else:
        cmd = [sys.executable, "pretrain_gpt.py", *flags]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    first = None
    lines, tail = [], []
    setup: dict[str, float] = {}  # Megatron's set-up lines: seconds to initialize, the set-up timers (max over ranks)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            tail = (tail + [line])[-30:]
            if line.startswith("time to initialize megatron (seconds): "):
                setup["init s"] = float(line.rsplit(":", 1)[1])
            for timer, key in (("model-and-optimizer-setup", "model+optimizer s"),
                               ("train/valid/test-data-iterators-setup", "data s")):
                if line.lstrip().startswith(timer + " ") and "(" in line:
                    setup[key] = float(line.rsplit(",", 1)[1].strip(" )\n")) / 1e3
            if "] iteration " in line:
                if first is None:
                    first = time.time() - t0
                lines.append(parse_train_log_line(line))
            if time.time() - t0 > timeout:
                proc.kill()
                break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    row = {"shape": name, "flags": " ".join([*settings, *extra]) or "(defaults)", "data": "real" if data_path else "mock",
           "nproc": nproc}
    steady = [d for d in lines if d["iteration"] > warmup]
    if proc.returncode != 0 or not steady:
        row["error"] = f"exit {proc.returncode}: " + "".join(tail)[-1500:]
        return row
    row["TFLOP/s/GPU"] = statistics.median(d["throughput per GPU (TFLOP/s/GPU)"] for d in steady)
    row["ms/iter"] = statistics.median(d["elapsed time per iteration (ms)"] for d in steady)
    row["tokens/s/GPU"] = statistics.median(d.get("tokens/s/GPU", 0.0) for d in steady)
    row["MFU %"] = statistics.median(d["MFU"] for d in steady) if "MFU" in steady[0] else None
    row["% of matmul peak"] = 100 * row["TFLOP/s/GPU"] / matmul_peak if matmul_peak else None
    row["peak GiB"] = max(d.get("peak mem (GiB)", 0.0) for d in steady)
    row["first iter s"] = first
    row.update(setup)
    if first is not None and len(setup) == 3:  # the rest of the time to the first line: its iteration (compilation)
        row["first iteration s"] = first - sum(setup.values())
    row["final loss"] = steady[-1].get("lm loss")
    return row


def environment() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return (f"{datetime.date.today()} | {gpu} x{torch.cuda.device_count()} | torch {torch.__version__} | "
            f"Python {platform.python_version()} | commit {commit}")


COLUMNS = ["shape", "flags", "data", "nproc", "TFLOP/s/GPU", "MFU %", "% of matmul peak", "tokens/s/GPU", "ms/iter",
           "peak GiB", "first iter s", "final loss"]


def markdown(rows: list[dict]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3g}"
        return "" if v is None else str(v)

    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['shape']} | {r['flags']} | {r['data']} | {r['nproc']} | failed: "
                       f"{r['error'].splitlines()[-1] if r['error'].strip() else r['error']} |")
        else:
            out.append("| " + " | ".join(cell(r.get(c)) for c in COLUMNS) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", help=f"default all but tiny: {', '.join(SHAPES)}")
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=8, help="iterations left out of the medians")
    ap.add_argument("--extra", action="append", default=None,
                    help="extra pretrain_gpt.py flags, led by NAME=VALUE environment settings if any; repeat to "
                         "run every shape once per value")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=400, help="seconds per run")
    ap.add_argument("--output", default=None, help="also write the table (markdown) here")
    ap.add_argument("--data", choices=["mock", "real"], default="mock",
                    help="mock: --mock-data; real: a preprocessed .bin/.idx dataset written first")
    ap.add_argument("--matmul-peak", type=float, default=None,
                    help="bf16 matmul TFLOP/s to compare against (default: measured on this GPU)")
    ap.add_argument("--results", default=None, help="append the table with its environment to this file")
    ap.add_argument("--title", default="Throughput", help="heading of the section --results appends")
    a = ap.parse_args(glue_flag_values(sys.argv[1:] if argv is None else argv))
    unknown = [s for s in a.shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    peak = a.matmul_peak or measure_matmul_peak()
    rows = []
    with tempfile.TemporaryDirectory(prefix="megatrain-bench-") as tmp_dir:
        for extra in a.extra or [""]:
            for name in a.shapes or [s for s in SHAPES if s != "tiny"]:
                data_path = (make_real_dataset(Path(tmp_dir), SHAPES[name], a.iters, a.nproc)
                             if a.data == "real" else None)
                row = run_one(name, a.iters, a.warmup, shlex.split(extra), a.nproc, a.timeout, data_path, peak)
                rows.append(row)
                print({k: v for k, v in row.items() if k != "error"}, row.get("error", "")[-800:], flush=True)
    env = environment() + (f" | bf16 matmul peak {peak:.0f} TFLOP/s" if peak else "")
    table = f"{env}\n\n{markdown(rows)}\n"
    print(table)
    if a.output:
        atomic_write_text(a.output, table)
    if a.results:
        previous = Path(a.results).read_text(encoding="utf-8") if os.path.exists(a.results) else ""
        section = f"## {a.title}\n\n{table}"
        atomic_write_text(a.results, f"{previous.rstrip()}\n\n{section}" if previous.strip() else section)


if __name__ == "__main__":
    main()
