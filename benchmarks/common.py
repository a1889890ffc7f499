"""Small helpers shared by the benchmark scripts."""

from __future__ import annotations

import platform


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
