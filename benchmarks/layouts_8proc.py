"""The multi-GPU layouts of the expert-parallel / new-families issue, run as gloo processes on the CPU.

    python benchmarks/layouts_8proc.py                     # every case, 50 steps, fp32
    python benchmarks/layouts_8proc.py --cases moe --steps 20 --output layouts.md

Each case trains a shrunk model of its family through the real entry point (``pretrain_gpt.py``,
``pretrain_bert.py``, ``pretrain_t5.py``) for ``--steps`` iterations, once in one process and once per
layout under ``torchrun --nproc_per_node N`` (gloo, fp32, no dropout), on the same data (the
one-process run pads the vocabulary as the layout does: Megatron pads to a multiple of
``--make-vocab-size-divisible-by`` x TP, and the padded rows take part in the softmax), and reports
each layout's largest relative difference of the logged lm loss from the one-process run over all
steps, its first and last loss, and its wall time (on a CPU that is not a speed figure: N processes
share the machine's cores). The GPU rows of the issue (bf16, NCCL, TFLOP/s, all-to-all share) need
4 and 8 GPUs and are not measured here.

- ``moe``: a Mixtral-style model (8 experts, top-2, aux-loss balancing, grouped GEMM, all-to-all
  dispatcher; GQA, RMSNorm, RoPE, SwiGLU) on --mock-data: EP=4 on 4 processes, EP=8 on 8, EP=4 x TP=2
  on 8.
- ``bert``: BERT on a generated sentence-level WordPiece corpus: TP=2 x PP=2 x DP=2 on 8 processes.
- ``t5``: T5 (span corruption with 100 sentinels) on the same corpus: TP=2 x DP=4 on 8 processes.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.common import emit_table  # noqa: E402
from megatrain.training.logging import parse_train_log_line  # noqa: E402

COMMON = ["--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
          "--clip-grad", "1.0", "--weight-decay", "0.01", "--log-interval", "1", "--eval-iters", "0",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--device", "cpu", "--num-workers", "0",
          "--seed", "1234"]
MOE = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
       "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
       "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
       "--disable-bias-linear", "--num-experts", "8", "--moe-router-topk", "2",
       "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm",
       "--moe-token-dispatcher-type", "alltoall", "--seq-length", "64", "--max-position-embeddings", "64",
       "--micro-batch-size", "1", "--global-batch-size", "8", "--mock-data", "--tokenizer-type", "NullTokenizer",
       "--vocab-size", "255"]
BERT = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
        "--split", "98,2,0", "--tokenizer-type", "BertWordPieceLowerCase"]
T5 = ["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
      "--kv-channels", "16", "--ffn-hidden-size", "128", "--encoder-seq-length", "64", "--decoder-seq-length", "32",
      "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
      "--vocab-extra-ids", "100", "--split", "98,2,0", "--tokenizer-type", "BertWordPieceLowerCase"]
DIVISIBLE_BY = 128  # Megatron's default --make-vocab-size-divisible-by
CASES = {
    "moe": ("pretrain_gpt.py", MOE, [("EP=4", 4, ["--expert-model-parallel-size", "4"]),
                                     ("EP=8", 8, ["--expert-model-parallel-size", "8"]),
                                     ("EP=4 x TP=2", 8, ["--expert-model-parallel-size", "4",
                                                         "--tensor-model-parallel-size", "2",
                                                         "--sequence-parallel"])]),
    "bert": ("pretrain_bert.py", BERT, [("TP=2 x PP=2 x DP=2", 8, ["--tensor-model-parallel-size", "2",
                                                                    "--pipeline-model-parallel-size", "2"])]),
    "t5": ("pretrain_t5.py", T5, [("TP=2 x DP=4", 8, ["--tensor-model-parallel-size", "2"])]),
}


def corpus_flags(root: Path) -> list[str]:
    """A generated sentence-level WordPiece corpus (the end-to-end tests' generator)."""
    from tests.e2e.bert_corpus import write_corpus

    paths = write_corpus(root, documents=600)
    return ["--data-path", paths["data_path"], "--vocab-file", paths["vocab"]]


def launch(script: str, flags: list[str], nproc: int, timeout: int) -> tuple[list[float], float, str]:
    cmd = [sys.executable, script] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone", script]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
           "CUDA_VISIBLE_DEVICES": "", "HOME": str(Path.home())}
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    losses = [parse_train_log_line(line)["lm loss"] for line in proc.stdout.splitlines() if "] iteration " in line]
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return losses, wall, f"exit {proc.returncode}: {tail[-200:]}"
    return losses, wall, ""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--timeout", type=int, default=1800, help="seconds for one launch")
    p.add_argument("--output", default=None, help="also write the markdown table to this file")
    args = p.parse_args(argv)
    lines = [f"### Multi-process layouts on the CPU (gloo, fp32), {args.steps} steps", "",
             f"{datetime.date.today()} · torch {torch.__version__} · "
             f"{subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO, capture_output=True, text=True).stdout.strip()}",
             "", "| case | layout | processes | max rel. diff of lm loss vs 1 process | first loss | last loss "
             "| wall s (1 process / layout) |", "|---|---|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        data = None
        for case in args.cases:
            script, flags, layouts = CASES[case]
            flags = [*flags, *COMMON, "--train-iters", str(args.steps), "--lr-decay-iters", str(args.steps)]
            if case in ("bert", "t5"):
                data = data or corpus_flags(Path(tmp))
                flags += data
            references: dict[int, tuple[list[float], float, str]] = {}
            for name, nproc, extra in layouts:
                tp = int(extra[extra.index("--tensor-model-parallel-size") + 1]) if (
                    "--tensor-model-parallel-size" in extra) else 1
                if tp not in references:
                    references[tp] = launch(script, [*flags, "--make-vocab-size-divisible-by", str(DIVISIBLE_BY * tp)],
                                            1, args.timeout)
                ref, ref_wall, err = references[tp]
                if err or len(ref) != args.steps:
                    lines.append(f"| {case} | {name}: its 1-process run | 1 | error: "
                                 f"{err or f'{len(ref)} steps logged'} | | | |")
                    print(lines[-1], flush=True)
                    continue
                losses, wall, err = launch(script, [*flags, *extra, "--make-vocab-size-divisible-by",
                                                    str(DIVISIBLE_BY)], nproc, args.timeout)
                if err or len(losses) != len(ref):
                    lines.append(f"| {case} | {name} | {nproc} | error: {err or f'{len(losses)} steps logged'} "
                                 "| | | |")
                else:
                    diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
                    lines.append(f"| {case} | {name} | {nproc} | {diff:.1e} | {losses[0]:.4f} | {losses[-1]:.4f} "
                                 f"| {ref_wall:.0f} / {wall:.0f} |")
                print(lines[-1], flush=True)
    lines.append(f"\nCommand: `python benchmarks/layouts_8proc.py {' '.join(argv or sys.argv[1:])}`")
    emit_table(lines, args.output)


if __name__ == "__main__":
    main()
