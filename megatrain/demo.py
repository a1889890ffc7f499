"""`make demo`: the whole user journey on a built-in corpus, with the commands a user would type.

1. build a jsonl corpus from the Python standard library sources of this interpreter;
2. `megatrain train-tokenizer` trains a byte-level BPE on it;
3. `tools/preprocess_data.py` tokenizes it into Megatron .bin/.idx files;
4. `pretrain_gpt.py` trains a small GPT (CPU, or GPU when present) and saves a checkpoint;
5. `tools/generate.py` prints a completion from the checkpoint.
"""

from __future__ import annotations

import json
import random
import shlex
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from megatrain.atomic_io import atomic_path
from megatrain.flags import OneLineArgumentParser

REPO = Path(__file__).resolve().parents[1]


def build_corpus(out: Path, max_bytes: int) -> int:
    """One document per stdlib source file, until ``max_bytes`` of text; returns the document count."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    random.Random(0).shuffle(files)  # a fixed mix of modules, so every split sees typical code
    total = docs = 0
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for p in files:
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            f.write(json.dumps({"text": text}) + "\n")
            total += len(text.encode("utf-8"))
            docs += 1
            if total >= max_bytes:
                break
    return docs


def run(step: str, display: list[str], argv: list[str]) -> None:
    print(f"\n=== {step}\n$ {' '.join(shlex.quote(a) for a in display)}", flush=True)
    t0 = time.time()
    subprocess.run(argv, check=True, cwd=REPO)
    print(f"=== done in {time.time() - t0:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = OneLineArgumentParser(prog="megatrain demo", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "demo_out"), help="working directory for the demo's files")
    ap.add_argument("--train-iters", type=int, default=300)
    ap.add_argument("--corpus-mb", type=float, default=4.0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    t_start = time.time()

    corpus = out / "corpus.jsonl"
    print(f"=== building a corpus from the Python standard library ({sysconfig.get_paths()['stdlib']})")
    docs = build_corpus(corpus, int(args.corpus_mb * 2**20))
    print(f"=== {docs} documents, {corpus.stat().st_size / 2**20:.1f} MiB -> {corpus}")

    tok = out / "tokenizer"
    cmd = ["train-tokenizer", "--input", str(corpus), "--vocab-size", "4096", "--output-dir", str(tok)]
    run("training a byte-level BPE tokenizer", ["megatrain", *cmd], [py, "-m", "megatrain", *cmd])

    prefix = out / "data" / "stdlib"
    (out / "data").mkdir(exist_ok=True)
    tok_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"),
                 "--merge-file", str(tok / "merges.txt")]
    cmd = ["tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(prefix), *tok_flags,
           "--append-eod", "--workers", "2"]
    run("tokenizing into Megatron .bin/.idx files", ["python", *cmd], [py, *cmd])

    ckpt = out / "checkpoints"
    cmd = ["pretrain_gpt.py",
           "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
           "--max-position-embeddings", "128", "--micro-batch-size", "16", "--global-batch-size", "16",
           "--train-iters", str(args.train_iters), "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
           "--lr-warmup-iters", "20", "--weight-decay", "0.1", "--clip-grad", "1.0",
           "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
           "--data-path", f"{prefix}_text_document", "--split", "98,2,0", *tok_flags,
           "--log-interval", "20", "--eval-interval", "100", "--eval-iters", "5",
           "--save", str(ckpt), "--tensorboard-dir", str(out / "tensorboard"), "--num-workers", "0"]
    run("training a small GPT", ["python", *cmd], [py, *cmd])

    cmd = ["tools/generate.py", "--load", str(ckpt), "--prompt", "def main(", "--prompt", "import os\n",
           "--tokens-to-generate", "48", "--greedy"]
    run("generating from the checkpoint", ["python", *cmd], [py, *cmd])
    print(f"\n=== demo finished in {time.time() - t_start:.0f} s; files under {out}")
    print(f"=== TensorBoard: tensorboard --logdir {out / 'tensorboard'}")


if __name__ == "__main__":
    main()
