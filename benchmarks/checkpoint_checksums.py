"""The cost of checkpoint checksums (`megatrain.checkpoint.integrity`): GB/s of the block CRC-32
over files in the page cache, for one large file and for several, with 1 thread and with all.

    python benchmarks/checkpoint_checksums.py [--gb 2] [--dir /tmp]

It also prints the time this gives for a checkpoint of N parameters with fp32 weights and Adam
states (12 bytes per parameter; --params, default 1.7e9). Reading from storage adds the disk or
network file system's own time on a cold cache.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain.checkpoint import integrity  # noqa: E402
from megatrain.host_threads import host_threads  # noqa: E402


def _write(path: str, size: int) -> None:
    chunk = os.urandom(64 << 20)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            f.write(chunk[:min(left, len(chunk))])
            left -= len(chunk)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=2.0, help="data to checksum per case (GB)")
    p.add_argument("--dir", default=None, help="where to write the test files (default: the temp dir)")
    p.add_argument("--params", type=float, default=1.7e9)
    a = p.parse_args()
    total = int(a.gb * 1e9)
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        _write(os.path.join(d, "one.distcp"), total)
        for i in range(4):
            _write(os.path.join(d, f"part{i}.distcp"), total // 4)
        cases = {"one file": ["one.distcp"], "4 files": [f"part{i}.distcp" for i in range(4)]}
        integrity.compute_checksums(d, cases["one file"])  # the page cache holds them now
        best = 0.0
        for name, files in cases.items():
            for threads in sorted({1, host_threads()}):
                t0 = time.perf_counter()
                integrity.compute_checksums(d, files, threads=threads)
                rate = total / (time.perf_counter() - t0) / 1e9
                best = max(best, rate)
                print(f"{name:9s} {threads:2d} threads: {rate:6.2f} GB/s ({1 / rate:.3f} s per GB)")
    size = a.params * 12 / 1e9
    print(f"a {a.params:.3g}-parameter checkpoint (fp32 weights + Adam, {size:.1f} GB): {size / best:.1f} s at "
          f"{best:.2f} GB/s from the page cache, split over the ranks that verify it")


if __name__ == "__main__":
    main()
