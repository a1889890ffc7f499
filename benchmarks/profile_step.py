"""Where the time of a training step goes: torch.profiler over a few steps of the real Trainer.

    python benchmarks/profile_step.py                          # the 1.7B shape, defaults of the run
    python benchmarks/profile_step.py --shape gpt2-124m --out prof/ --extra "--cross-entropy-chunk-size 0"
    python benchmarks/profile_step.py --shape tiny --device cpu --steps 2   # smoke test anywhere
    torchrun --nproc_per_node 2 benchmarks/profile_step.py --extra "--tensor-model-parallel-size 2 --sequence-parallel"

Builds the model, optimizer and mock data through ``megatrain.training.trainer.Trainer`` with the
flags of ``benchmarks/throughput.py`` (bf16, --mock-data), runs ``--warmup`` steps (compilation,
allocator warm-up) and then profiles ``--steps`` calls of ``Trainer.train_step`` -- the code the
log line times. Writes into ``--out``:

- ``kernels.txt``: the top ``--top`` kernels by device time (name, calls, total ms, % of the
  profiled device time, mean us), followed by a summary per category (matmul, attention,
  optimizer, cross-entropy/softmax, norms/elementwise, copies, communication, other) and, on a
  GPU, the device's idle time: the gaps between kernels, filed under the kernel that ended each
  wait (what the host had not queued yet) and the host operator that queued it, with its callers;
- ``summary.json``: the same as data, with wall ms per step, device-busy ms per step, peak memory;
- ``trace.json.gz`` (with ``--trace``): the Chrome/Perfetto trace.

Under torchrun every rank trains and rank 0 profiles itself and writes the report.

The printed table is what to read first: if device-busy time per step is well below the wall time,
the host (launches, syncs, data) is the bottleneck, and the idle table says before which kernels
the GPU waited; otherwise the category shares say which kernels to make faster.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shlex
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from common import glue_flag_values  # noqa: E402
from throughput import COMMON, SHAPES  # noqa: E402

CATEGORIES = [  # first match wins; patterns are matched against lower-cased kernel names
    ("communication", r"nccl|allreduce|all_reduce|reduce_scatter|allgather"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn.*(mha|attn)"),
    ("matmul", r"gemm|cutlass|sm90_xmma|xmma|nvjet|matmul|\bmm\b|cublas|ampere_bf16|sm80_|sm90_"),
    ("optimizer/grad-norm", r"adam|multi_tensor|foreach|fused_adamw"),
    ("cross-entropy/softmax", r"softmax|log_softmax|nll_loss|cross_entropy|logsumexp|_chunk_"),
    ("copies", r"memcpy|memset|copy_|to_copy|cat_|catarray"),
    ("norms/elementwise", r"layer_norm|layernorm|rms|norm|elementwise|vectorized|triton|reduce|gelu|silu|mul|add"),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def build_args(shape: str, extra: list[str], steps: int, device: str | None):
    from megatrain.training.arguments import parse_args

    flags = [*SHAPES[shape], *COMMON, "--mock-data", "--train-iters", str(steps + 100), "--num-workers", "2", *extra]
    if device:
        flags += ["--device", device]
    if device == "cpu":
        flags = [f for f in flags if f != "--bf16"]
    return parse_args(flags)


def kernel_intervals(prof: "torch.profiler.profile") -> list[tuple[float, float, str, str]]:
    """(start us, end us, name, launcher) of every device kernel, in start order.

    Kernel events are the profiler's events on the device, without the device-side copies of
    ``record_function`` ranges (e.g. "Optimizer.step#AdamW.step"): those span kernels that are
    listed themselves, so counting them would count the kernels twice. ``launcher``: the host
    operator that queued the kernel and its callers, innermost first ("aten::zero_ < aten::zeros"),
    from the profiler's correlation ids ("" where the profiler links none).
    """
    from torch.autograd import DeviceType

    events = prof.events()
    host_ops = {evt.id: evt for evt in events
                if getattr(evt, "device_type", DeviceType.CPU) == DeviceType.CPU and not evt.is_async}
    out = []
    for evt in events:
        if getattr(evt, "device_type", DeviceType.CPU) == DeviceType.CPU:
            continue
        if getattr(evt, "is_user_annotation", False) or "#" in evt.name:
            continue
        out.append((float(evt.time_range.start), float(evt.time_range.end), evt.name,
                    launcher_chain(host_ops.get(getattr(evt, "linked_correlation_id", 0)))))
    out.sort()
    return out


def launcher_chain(op: object, depth: int = 3) -> str:
    """``op``'s name and its callers' (``cpu_parent``), innermost first, at most ``depth`` names."""
    names = []
    while op is not None and len(names) < depth:
        names.append(op.name)  # type: ignore[attr-defined]
        op = getattr(op, "cpu_parent", None)
    return " < ".join(names)


def kernel_rows(prof: "torch.profiler.profile", intervals: list[tuple[float, float, str]]) -> list[dict]:
    """Device kernels (``intervals`` from :func:`kernel_intervals`) aggregated by name: calls and
    total device microseconds; should a torch version not list kernels, the operators' self device
    time is used instead (names are then aten operators)."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for start, end, name, _ in intervals:
        totals[name][0] += 1
        totals[name][1] += end - start
    if not totals:
        for e in prof.key_averages():
            us = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
            if us > 0:
                totals[e.key] = [e.count, us]
    rows = [{"name": n, "calls": int(c), "total_us": t} for n, (c, t) in totals.items()]
    rows.sort(key=lambda r: r["total_us"], reverse=True)
    return rows


def idle_gaps(intervals: list[tuple[float, float, str, str]], min_us: float = 5.0) -> list[dict]:
    """Where the device waited: every stretch of at least ``min_us`` with no kernel running, filed
    under the kernel that ended the wait (the work the host had not queued yet) and the host
    operator that queued it (``intervals`` of :func:`kernel_intervals`), totalled by the two.

    Rows (largest total first): name, launcher, gaps, total_us, max_us.
    """
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    busy_until = None
    for start, end, name, launcher in intervals:
        if busy_until is not None and start - busy_until >= min_us:
            gap = start - busy_until
            row = totals[(name, launcher)]
            row[0] += 1
            row[1] += gap
            row[2] = max(row[2], gap)
        busy_until = end if busy_until is None else max(busy_until, end)
    rows = [{"name": n, "launcher": who, "gaps": int(c), "total_us": t, "max_us": m}
            for (n, who), (c, t, m) in totals.items()]
    rows.sort(key=lambda r: r["total_us"], reverse=True)
    return rows


def render_gaps(rows: list[dict], steps: int, top: int) -> str:
    total = sum(r["total_us"] for r in rows)
    lines = ["", f"device idle (gaps of 5 us or more between kernels): {total / 1000 / steps:.2f} ms/step in "
             f"{sum(r['gaps'] for r in rows) / steps:.0f} gaps; the kernels that ended the longest waits:",
             f"{'#':>3} {'idle ms/step':>12} {'gaps/step':>9} {'max us':>8}  kernel after the gap  <- host operator that "
             "queued it < its callers"]
    for i, r in enumerate(rows[:top], 1):
        name = r["name"] if len(r["name"]) <= 80 else r["name"][:77] + "..."
        who = f"  <- {r['launcher']}" if r.get("launcher") else ""
        lines.append(f"{i:>3} {r['total_us'] / 1000 / steps:>12.2f} {r['gaps'] / steps:>9.1f} {r['max_us']:>8.0f}  "
                     f"{name}{who}")
    return "\n".join(lines)


def cpu_rows(prof: "torch.profiler.profile") -> list[dict]:
    """Without a device (smoke test): top operators by self CPU time."""
    rows = [{"name": e.key, "calls": e.count, "total_us": float(e.self_cpu_time_total)}
            for e in prof.key_averages()]
    rows.sort(key=lambda r: r["total_us"], reverse=True)
    return rows


def render(rows: list[dict], top: int, steps: int, wall_ms: float, header: str) -> tuple[str, dict]:
    busy_us = sum(r["total_us"] for r in rows)
    by_cat: dict[str, float] = defaultdict(float)
    for r in rows:
        by_cat[category(r["name"])] += r["total_us"]
    lines = [header, "",
             f"profiled steps: {steps} | wall ms/step: {wall_ms:.1f} | busy ms/step (sum of kernel times): "
             f"{busy_us / 1000 / steps:.1f}", "",
             f"{'#':>3} {'total ms/step':>13} {'%':>6} {'calls/step':>10} {'mean us':>9}  kernel"]
    for i, r in enumerate(rows[:top], 1):
        name = r["name"] if len(r["name"]) <= 110 else r["name"][:107] + "..."
        lines.append(f"{i:>3} {r['total_us'] / 1000 / steps:>13.2f} {100 * r['total_us'] / max(busy_us, 1e-9):>6.1f} "
                     f"{r['calls'] / steps:>10.1f} {r['total_us'] / max(r['calls'], 1):>9.1f}  {name}")
    lines += ["", f"{'category':<24} {'ms/step':>9} {'%':>6}"]
    for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"{cat:<24} {us / 1000 / steps:>9.2f} {100 * us / max(busy_us, 1e-9):>6.1f}")
    summary = {"steps": steps, "wall_ms_per_step": wall_ms, "busy_ms_per_step": busy_us / 1000 / steps,
               "categories_ms_per_step": {k: v / 1000 / steps for k, v in by_cat.items()},
               "top_kernels": [{**r, "ms_per_step": r["total_us"] / 1000 / steps} for r in rows[:top]]}
    return "\n".join(lines), summary


def profile_loop(step, steps: int, sync, cuda: bool) -> tuple["torch.profiler.profile", float]:
    """``steps`` calls of ``step`` under torch.profiler (CPU, and CUDA kernels when ``cuda``), then
    ``sync``; returns the profile and the wall ms per step."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.time()
        for _ in range(steps):
            step()
        sync()
        wall_ms = (time.time() - t0) * 1000 / steps
    return prof, wall_ms


def kernel_report(prof: "torch.profiler.profile", cuda: bool, steps: int, wall_ms: float, header: str,
                  top: int) -> tuple[str, dict]:
    """The kernel table, categories and (CUDA) the device's idle gaps of a peer's profile, as
    ``render`` and ``render_gaps`` print them; the summary gets ``idle_ms_per_step`` and ``idle_before``."""
    intervals = kernel_intervals(prof) if cuda else []
    rows = kernel_rows(prof, intervals) if cuda else cpu_rows(prof)
    table, summary = render(rows, top, steps, wall_ms, header)
    if cuda:
        gaps = idle_gaps(intervals)
        table += "\n" + render_gaps(gaps, steps, min(top, 20))
        summary["idle_ms_per_step"] = sum(r["total_us"] for r in gaps) / 1000 / steps
        summary["idle_before"] = [{**r, "ms_per_step": r["total_us"] / 1000 / steps} for r in gaps[:top]]
    return table, summary


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1.7b", choices=sorted(SHAPES))
    ap.add_argument("--extra", default="", help="extra pretrain_gpt.py flags, e.g. \"--no-torch-compile\"")
    ap.add_argument("--warmup", type=int, default=4, help="steps before profiling (compilation happens here)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=os.environ.get("OUT", "profile_out"), help="output folder (default $OUT)")
    ap.add_argument("--trace", action="store_true", help="also write trace.json.gz (Chrome/Perfetto)")
    ap.add_argument("--device", default=None, help="cpu for a smoke test (default: cuda when available)")
    a = ap.parse_args(glue_flag_values(sys.argv[1:] if argv is None else argv))

    from megatrain.parallel.distributed import destroy_distributed
    from megatrain.training.trainer import Trainer

    args = build_args(a.shape, shlex.split(a.extra), a.warmup + a.steps, a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(args)
    cuda = trainer.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(trainer.device)) if cuda else (lambda: None)
    try:
        t0 = time.time()
        for _ in range(a.warmup):  # as the training loop does: an iteration settles when the next is queued
            trainer.queue_step()
        trainer.settle()
        sync()
        print(f"warm-up: {a.warmup} steps in {time.time() - t0:.1f} s (compilation included)", flush=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats(trainer.device)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            t0 = time.time()
            trainer.flags_wait_s = 0.0
            for _ in range(a.steps):
                trainer.queue_step()
            trainer.settle()
            sync()
            wall_ms = (time.time() - t0) * 1000 / a.steps
            wait_ms = trainer.flags_wait_s * 1000 / a.steps
        peak_gib = torch.cuda.max_memory_allocated(trainer.device) / 2**30 if cuda else None
    finally:
        trainer.close()
        destroy_distributed()

    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun: rank 0 reports for all
        return
    intervals = kernel_intervals(prof) if cuda else []
    rows = kernel_rows(prof, intervals) if cuda else cpu_rows(prof)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    header = (f"{a.shape} | {args.global_batch_size} x {args.seq_length} tokens/step | flags: {a.extra or '(defaults)'}"
              + (f" | rank 0 of {world}" if world > 1 else "")
              + f" | compile {args.use_torch_compile} | CE chunk {args.cross_entropy_chunk_size} | torch "
              f"{torch.__version__} | {torch.cuda.get_device_name(trainer.device) if cuda else 'cpu'}"
              + (f" | peak {peak_gib:.1f} GiB (profiled steps)" if peak_gib is not None else "")
              + ("" if cuda else " | CPU: operators by self CPU time"))
    table, summary = render(rows, a.top, a.steps, wall_ms, header)
    table += (f"\nhost waiting for the iterations' flags: {wait_ms:.1f} ms/step (near 0: the host, not the device, "
              "sets the pace)")
    summary["flags_wait_ms_per_step"] = wait_ms
    if cuda:  # where the GPU waited for the host
        gaps = idle_gaps(intervals)
        table += "\n" + render_gaps(gaps, a.steps, min(a.top, 20))
        summary["idle_ms_per_step"] = sum(r["total_us"] for r in gaps) / 1000 / a.steps
        summary["idle_before"] = [{**r, "ms_per_step": r["total_us"] / 1000 / a.steps} for r in gaps[:a.top]]
    summary.update(shape=a.shape, extra=a.extra, peak_gib=peak_gib, torch=torch.__version__)
    write_atomic(out / "kernels.txt", (table + "\n").encode())
    write_atomic(out / "summary.json", json.dumps(summary, indent=1).encode())
    if a.trace:
        raw = out / "trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(out / "trace.json.gz.tmp", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(out / "trace.json.gz.tmp", out / "trace.json.gz")
        raw.unlink()
    print(table, flush=True)


if __name__ == "__main__":
    main()
