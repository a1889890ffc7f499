"""The kernel table of a torch.profiler Chrome trace (``--profile`` of the training scripts writes one).

    python benchmarks/trace_kernels.py profile/trace_rank0_iters10-12.json --iterations 2
    python benchmarks/trace_kernels.py trace.json.gz --top 30 --output kernels.md

Reads the trace's device events (``cat``: kernel, gpu_memcpy, gpu_memset), and prints per iteration:
the top ``--top`` kernels by device time (calls, ms, share, mean us), the sum per category
(``benchmarks/profile_step.py``'s categories: matmul, attention, copies, ...), the device's busy time
and the span from the first to the last device event, so busy / span says how much of the window the
GPU worked (the rest: it waited for the host, or for a synchronisation); then where it waited: each gap
of 5 us or more filed under the kernel that ended it and the host operator that queued that kernel
(the trace's runtime launch with the kernel's correlation id, inside the innermost ``cpu_op`` of its
thread), as ``profile_step.py``'s idle table.

``--before REGEX`` adds, for the device events whose name matches (e.g. ``Memset``), what came just before
each on its stream and how long the device waited, grouped by the host operators that queued it (six deep,
without the profiler's "Command Buffer Full" markers) and the event before: where such events come from.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_trace(path: str) -> list[dict]:
    """Every complete ("X") event of the trace."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]


def device_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("cat") in DEVICE_CATEGORIES]


def launchers(events: list[dict], depth: int = 2, skip: tuple[str, ...] = ()) -> dict[int, str]:
    """Correlation id -> the host operators around the runtime call that launched it (innermost first,
    ``depth`` of them, joined by " < "), from the ``cpu_op`` events of the launching thread (nested on
    a thread: one sweep in time order with the operators still open on a stack)."""
    ops: dict[object, list[dict]] = defaultdict(list)
    calls: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("name") not in skip:
            ops[e.get("tid")].append(e)
        elif e.get("cat") == "cuda_runtime" and (e.get("args") or {}).get("correlation") is not None:
            calls[e.get("tid")].append(e)
    found: dict[int, str] = {}
    for tid, launches in calls.items():
        opened = sorted(ops.get(tid, ()), key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        i = 0
        for call in sorted(launches, key=lambda e: e["ts"]):
            while i < len(opened) and opened[i]["ts"] <= call["ts"]:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] < opened[i]["ts"]:
                    stack.pop()
                stack.append(opened[i])
                i += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < call["ts"]:
                stack.pop()
            found[call["args"]["correlation"]] = " < ".join(op["name"] for op in reversed(stack[-depth:]))
    return found


def gap_lines(events: list[dict], iterations: int, top: int) -> list[str]:
    from profile_step import idle_gaps, render_gaps

    launched = launchers(events)
    intervals = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"],
                        launched.get((e.get("args") or {}).get("correlation"), ""))
                       for e in device_events(events))
    return render_gaps(idle_gaps(intervals), iterations, top).splitlines()


def before_lines(events: list[dict], pattern: str, iterations: int, top: int) -> list[str]:
    """For each device event whose name matches ``pattern``: the event before it on its stream and the gap,
    grouped by the host operators that queued it and that previous event (module doc, ``--before``)."""
    import re

    launched = launchers(events, depth=6, skip=("Command Buffer Full",))
    wanted = re.compile(pattern)
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    by_stream: dict[object, list[dict]] = defaultdict(list)
    for e in device_events(events):
        by_stream[(e.get("args") or {}).get("stream", e.get("tid"))].append(e)
    for stream_events in by_stream.values():
        stream_events.sort(key=lambda e: e["ts"])
        for prev, e in zip([None, *stream_events], stream_events):
            if not wanted.search(e["name"]):
                continue
            gap = 0.0 if prev is None else max(0.0, e["ts"] - (prev["ts"] + prev["dur"]))
            host = launched.get((e.get("args") or {}).get("correlation"), "") or "?"
            groups[(host, "-" if prev is None else prev["name"][:60])].append(gap)
    lines = ["", f"device events matching {pattern!r}: what queued them and what ran before, per iteration",
             "| calls/iter | gap us/iter | mean gap us | queued by (innermost first) | before it on its stream |",
             "|---:|---:|---:|---|---|"]
    for (host, prev), gaps in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"| {len(gaps) / iterations:g} | {sum(gaps) / iterations:.1f} | {sum(gaps) / len(gaps):.1f} | "
                     f"{host[:160]} | `{prev}` |")
    return lines


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals`` (us): concurrent streams counted once."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def table(events: list[dict], iterations: int, top: int) -> list[str]:
    from profile_step import category

    per_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        per_name[e["name"]].append(float(e["dur"]))
    total = sum(sum(v) for v in per_name.values())
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    busy = busy_time([(e["ts"], e["ts"] + e["dur"]) for e in events])
    lines = [f"{len(events)} device events over {iterations} iteration(s); per iteration: span "
             f"{span / iterations / 1e3:.2f} ms, device busy {busy / iterations / 1e3:.2f} ms "
             f"({busy / span:.0%} of the span)", "",
             "| kernel | calls/iter | ms/iter | share | mean us |", "|---|---:|---:|---:|---:|"]
    ranked = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    for name, durations in ranked[:top]:
        t = sum(durations)
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short}` | {len(durations) / iterations:g} | {t / iterations / 1e3:.3f} | "
                     f"{t / total:.1%} | {t / len(durations):.1f} |")
    per_category: dict[str, float] = defaultdict(float)
    for name, durations in per_name.items():
        per_category[category(name)] += sum(durations)
    lines += ["", "| category | ms/iter | share |", "|---|---:|---:|"]
    for cat, t in sorted(per_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {cat} | {t / iterations / 1e3:.3f} | {t / total:.1%} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a Chrome trace (.json or .json.gz) of torch.profiler")
    p.add_argument("--iterations", type=int, default=1, help="iterations the trace covers (the table is per one)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--output", default=None, help="also write the table here")
    p.add_argument("--before", default=None, metavar="REGEX",
                   help="for device events matching REGEX: what queued them and what ran before (module doc)")
    a = p.parse_args(argv)
    if a.iterations < 1:
        p.error("--iterations must be at least 1")
    try:
        everything = load_trace(a.trace)
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"{a.trace}: not a readable Chrome trace ({type(e).__name__}: {e})")
    events = device_events(everything)
    if not events:
        p.error(f"{a.trace}: no device events (profiled without CUDA?)")
    lines = table(events, a.iterations, a.top) + gap_lines(everything, a.iterations, a.top)
    if a.before:
        lines += before_lines(everything, a.before, a.iterations, a.top)
    text = "\n".join(lines)
    print(text)
    if a.output:
        Path(a.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
