"""Data preprocessing benchmarks: a table of named benchmarks, each a function returning rows.

    python benchmarks/preprocess.py                # all benchmarks
    python benchmarks/preprocess.py tokenize_gpt2  # only the named ones

``tokenize_gpt2`` runs the real ``tools/preprocess_data.py`` path (``preprocess()``) with
the GPT-2 BPE (``../shared/data/gpt2``) on a jsonl corpus of at least 50 MB built from the
running Python's standard library sources (one source file per document), with
``--workers 1`` and ``--workers 2``, and reports tokens/s overall and per worker.
``index_1e9`` times building the document/sample/shuffle indices for 1e9 tokens at
sequence length 4096 (``benchmarks/index_building.py`` has more cases, blending included).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import cpu_model  # noqa: E402

GPT2_DIR = REPO / ".." / "shared" / "data" / "gpt2"
CORPUS_MB = 50


class Skip(Exception):
    """A benchmark that cannot run here (missing files); the message says why."""


def build_stdlib_corpus(path: Path, min_mb: int = CORPUS_MB) -> tuple[int, int]:
    """jsonl of stdlib .py files, one per line, repeated until at least ``min_mb`` MB."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    texts = []
    for f in files:
        try:
            texts.append(Path(f).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    if not texts:
        raise Skip("no Python standard library sources found")
    docs = size = 0
    with open(path, "w", encoding="utf-8") as out:
        while size < min_mb * 1024 * 1024:
            for t in texts:
                line = json.dumps({"text": t}) + "\n"
                out.write(line)
                size += len(line.encode())
                docs += 1
                if size >= min_mb * 1024 * 1024:
                    break
    return docs, size


def bench_tokenize_gpt2(work: Path) -> list[dict]:
    from megatrain.data.preprocess import PreprocessConfig, PreprocessStats, preprocess
    from megatrain.data.tokenizers import TokenizerConfig, build_tokenizer

    vocab, merges = GPT2_DIR / "gpt2-vocab.json", GPT2_DIR / "gpt2-merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        raise Skip(f"GPT-2 vocab/merges not found in {GPT2_DIR.resolve()}")
    corpus = work / "stdlib.jsonl"
    docs, size = build_stdlib_corpus(corpus)
    tok_cfg = TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    backend = build_tokenizer(tok_cfg).backend
    rows = []
    for workers in (1, 2):
        cfg = PreprocessConfig(input=str(corpus), output_prefix=str(work / f"gpt2_w{workers}"),
                               tokenizer=tok_cfg, workers=workers, append_eod=True, progress=False)
        stats = PreprocessStats()
        t0 = time.perf_counter()
        preprocess(cfg, stats)
        secs = time.perf_counter() - t0
        rows.append({
            "benchmark": "tokenize_gpt2",
            "config": f"GPT2BPETokenizer[{backend}] --workers {workers} --append-eod",
            "docs": stats.documents,
            "MB": size / 1024 / 1024,
            "tokens": stats.tokens,
            "seconds": secs,
            "tokens/s": stats.tokens / secs,
            "tokens/s/worker": stats.tokens / secs / workers,
            "MB/s": size / 1024 / 1024 / secs,
        })
    return rows


def bench_index_1e9(work: Path) -> list[dict]:
    """Megatron-order GPT indices for 1e9 tokens at seq 4096 (synthetic document lengths)."""
    import numpy as np

    from megatrain.data.gpt_dataset import build_indices

    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 1200, size=int(1e9 / 600), dtype=np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    seq = 4096
    n_samples = int(2.5 * (tokens - 1) // seq)
    t0 = time.perf_counter()
    out = build_indices(sizes, np.arange(len(sizes), dtype=np.int32), n_samples, seq, 1234)
    secs = time.perf_counter() - t0
    return [{"benchmark": "index_1e9", "config": f"seq {seq}, {out['num_epochs']} epochs, {n_samples:,} samples",
             "docs": len(sizes), "tokens": tokens, "seconds": secs, "tokens/s": tokens * out["num_epochs"] / secs}]


#: name -> function(work_dir) returning table rows; other benchmarks are added here.
BENCHMARKS: dict[str, Callable[[Path], list[dict]]] = {
    "tokenize_gpt2": bench_tokenize_gpt2,
    "index_1e9": bench_index_1e9,
}

COLUMNS = ["benchmark", "config", "docs", "MB", "tokens", "seconds", "tokens/s", "tokens/s/worker", "MB/s"]


def format_table(rows: list[dict]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:,.2f}" if v < 1000 else f"{v:,.0f}"
        if isinstance(v, int):
            return f"{v:,}"
        return "" if v is None else str(v)

    cols = [c for c in COLUMNS if any(c in r for r in rows)] + sorted(
        {k for r in rows for k in r} - set(COLUMNS))
    cells = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(v.rjust(w) if v[:1].isdigit() else v.ljust(w) for v, w in zip(row, widths))
              for row in cells]
    return "\n".join(lines)


def environment() -> str:
    import numpy

    parts = [time.strftime("%Y-%m-%d"), f"CPU: {cpu_model()} ({os.cpu_count()} cores)",
             f"Python {platform.python_version()}", f"numpy {numpy.__version__}"]
    for mod in ("torch", "tiktoken", "tokenizers"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            pass
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default all: {', '.join(BENCHMARKS)})")
    parser.add_argument("--work-dir", default=None, help="Where to put corpora and outputs (default: a temp dir).")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    print(environment())
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        for name in args.names or list(BENCHMARKS):
            work = Path(tmp) / name
            work.mkdir()
            try:
                rows.extend(BENCHMARKS[name](work))
            except Skip as e:
                print(f"skipped {name}: {e}")
    if rows:
        print(format_table(rows))


if __name__ == "__main__":
    main()
