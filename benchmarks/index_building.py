"""Time Megatron-order index building: GPT indices for ~1e9 tokens, and blending.

Synthetic document lengths (no .bin needed); prints a table with the machine and versions.
    python benchmarks/index_building.py [--tokens 1e9] [--seq-length 4096] [--blend-samples 5e6]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatrain.data.blended_dataset import build_blending_indices, normalize_weights  # noqa: E402
from megatrain.data.gpt_dataset import build_indices  # noqa: E402
from common import cpu_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=float, default=1e9)
    p.add_argument("--mean-doc-length", type=int, default=600)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--epochs-requested", type=float, default=2.5,
                   help="samples requested, in epochs of the data (>1 exercises multi-epoch)")
    p.add_argument("--blend-samples", type=float, default=5e6)
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args()

    rng = np.random.default_rng(0)
    n_docs = int(a.tokens / a.mean_doc_length)
    sizes = rng.integers(1, 2 * a.mean_doc_length, size=n_docs, dtype=np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    n_samples = int(a.epochs_requested * (tokens - 1) // a.seq_length)
    docs = np.arange(n_docs, dtype=np.int32)

    rows = []
    t = time.perf_counter()
    out = build_indices(sizes, docs, n_samples, a.seq_length, a.seed)
    dt = time.perf_counter() - t
    rows.append((f"GPT indices: {n_docs:,} docs, {tokens:,} tokens, seq {a.seq_length}, "
                 f"{n_samples:,} samples ({out['num_epochs']} epochs, separate final "
                 f"{out['separate_final_epoch']})", dt))
    t = time.perf_counter()
    one = build_indices(sizes, docs, int(0.9 * (tokens - 1) // a.seq_length), a.seq_length, a.seed)
    rows.append((f"GPT indices: same data, one epoch ({one['sample_index'].shape[0] - 1:,} samples)",
                 time.perf_counter() - t))
    n_blend = int(a.blend_samples)
    for weights in ([0.3, 0.2, 0.5], [1, 1, 1], [0.7, 0.001, 0.299], [5, 1, 3, 2, 8, 0.5, 1, 1]):
        w = normalize_weights(weights)
        t = time.perf_counter()
        build_blending_indices(w, n_blend)
        rows.append((f"blending: {n_blend:,} samples, weights {weights}", time.perf_counter() - t))

    print(f"date: {datetime.date.today()}  cpu: {cpu_model()} ({os.cpu_count()} cores)  "
          f"python {platform.python_version()}  numpy {np.__version__}")
    width = max(len(r[0]) for r in rows)
    print(f"{'what':<{width}}  seconds")
    for name, sec in rows:
        print(f"{name:<{width}}  {sec:7.2f}")


if __name__ == "__main__":
    main()
