"""Where a benchmarked process's start-up compilation goes: one line per compiled frame (forward, then its
backward) appended at exit to the file named by ``COMPILE_REPORT`` (put this folder on ``PYTHONPATH``).

Used by ``benchmarks/device_round.sh`` around megatrain's and the peers' runs alike (no change to either):
the frame (file:line name), its wall seconds from the start of the process, dynamo/AOT/inductor seconds and
Triton's compile seconds, so the two sides' start-ups compare piece by piece.
"""

import atexit
import os
import sys
import time

_START = time.time()
_PATH = os.environ.get("COMPILE_REPORT")


def _report() -> None:
    utils = sys.modules.get("torch._dynamo.utils")
    metrics = utils.get_compilation_metrics() if utils is not None and _PATH else []
    if not metrics:
        return  # (inductor's compile workers inherit the variable and compile no frame)
    rows = [f"# {' '.join(sys.argv)[:200]} (pid {os.getpid()}, exit at {time.time() - _START:.1f} s)"]
    total = 0.0
    for m in metrics:
        g = lambda k: getattr(m, k, None) or 0  # noqa: E731 (fields differ between torch versions)
        begin = (g("start_time_us") / 1e6 or g("start_time")) - _START
        end = g("end_time_us") / 1e6 - _START if g("end_time_us") else begin
        where = f"{os.path.basename(str(g('co_filename') or '?'))}:{g('co_firstlineno')} {g('co_name') or '(backward)'}"
        total += end - begin
        rows.append(f"{g('compile_id')!s:>6} {where[:70]:<70} at {begin:7.1f} s, {end - begin:6.2f} s wall | "
                    f"frame {g('entire_frame_compile_time_s'):6.2f} aot {g('backend_compile_time_s'):6.2f} "
                    f"inductor {g('inductor_compile_time_s'):6.2f} triton {g('triton_compile_time_us') / 1e6:6.2f}"
                    + (f" | FAILED {g('fail_reason')}" if g("fail_reason") else ""))
    frames = sum(1 for m in metrics if getattr(m, "co_name", None))
    rows.append(f"# compiled frames: {frames} ({len(rows) - 1} lines with their backward passes), "
                f"{total:.1f} s wall in compilation")
    with open(_PATH, "a") as f:
        f.write("\n".join(rows) + "\n\n")


if _PATH:
    atexit.register(_report)
