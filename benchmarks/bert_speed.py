"""BERT pre-training speed side by side: ``pretrain_bert.py`` against Hugging Face transformers on the
same GPU, shape and batch, in one process tree of one device call. Prints a table.

    python benchmarks/bert_speed.py                        # BERT-large 340M, micro-batch 32
    python benchmarks/bert_speed.py --shape tiny --device cpu   # a smoke run anywhere

Rows:
Every row trains without dropout (the same work everywhere; dropout's cost is the same kind for all).

* megatrain: the real ``pretrain_bert.py`` (bf16, its defaults: torch.compile, fused AdamW on CUDA)
  on a sentence-level ``.bin/.idx`` dataset written here (documents of random WordPiece ids over a
  generated 30522-entry vocabulary) with ``--split 100,0,0``; TFLOP/s from its log line (Megatron's
  formula) and the median iteration time after the warm-up.
* transformers ``MegatronBertForPreTraining`` (the model class of Megatron's BERT; its attention is
  eager matmul-softmax-matmul, transformers has no SDPA path for it), ``torch.compile``, bf16
  autocast, fused AdamW, on random batches of the same shape with 15 % masked-LM labels and
  sentence-order labels.
* transformers ``BertForPreTraining`` with SDPA attention (post-norm BERT, the same matmul shapes),
  compiled likewise: the fastest BERT transformers offers.

For every row: tokens/s (samples x seq length per second), TFLOP/s by Megatron's formula for the
shape (the same FLOPs for every row), and that over the bf16 8192^3 matmul rate measured first.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import timed_hf_steps  # noqa: E402
from throughput import measure_matmul_peak  # noqa: E402

SHAPES = {  # layers, hidden, heads, seq, micro-batch
    "bert-large": (24, 1024, 16, 512, 32),
    "bert-base": (12, 768, 12, 512, 32),
    "tiny": (2, 64, 4, 64, 4),
}
VOCAB = 30522


def write_vocab(path: Path) -> None:
    special = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = [f"w{i}" for i in range((VOCAB - len(special)) * 4 // 5)]
    pieces = [f"##p{i}" for i in range(VOCAB - len(special) - len(words))]
    path.write_text("\n".join(special + words + pieces) + "\n", encoding="utf-8")


def write_sentences(prefix: Path, tokens: int, seed: int = 0) -> None:
    """Documents of 2-12 sentences of 8-64 WordPiece ids each (ids of words and ## pieces)."""
    import numpy as np

    from megatrain.data.indexed_dataset import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    written = 0
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        while written < tokens:
            lengths = rng.integers(8, 65, int(rng.integers(2, 13)))
            w.add_document(rng.integers(104, VOCAB, int(lengths.sum())), lengths=[int(n) for n in lengths])
            written += int(lengths.sum())


def flops(layers: int, hidden: int, seq: int, batch: int, vocab: int) -> float:
    """Megatron's transformer formula (what pretrain_bert.py logs), GELU MLP of 4h, no GQA."""
    h, L, s, B = hidden, layers, seq, batch
    per_token = 6 * h * 2 * 4 * h * L + 6 * L * (h * h * 3 + h * h) + 6 * h * vocab
    return float(B * s * per_token + 6 * B * s * s * L * h)


def run_megatrain(shape: str, iters: int, warmup: int, device: str, tmp: Path, timeout: int,
                  extra: str = "") -> dict:
    from megatrain.training.logging import parse_train_log_line

    L, h, n, s, b = SHAPES[shape]
    write_vocab(tmp / "vocab.txt")
    prefix = tmp / "bench_text_sentence"
    write_sentences(prefix, tokens=(iters + 4) * b * s * 2)
    cmd = [sys.executable, "pretrain_bert.py", "--num-layers", str(L), "--hidden-size", str(h),
           "--num-attention-heads", str(n), "--seq-length", str(s), "--max-position-embeddings", str(s),
           "--micro-batch-size", str(b), "--global-batch-size", str(b), "--train-iters", str(iters),
           "--lr", "1e-4", "--lr-decay-style", "linear", "--lr-warmup-iters", "2", "--weight-decay", "0.01",
           "--clip-grad", "1.0", "--vocab-file", str(tmp / "vocab.txt"), "--data-path", str(prefix),
           "--split", "100,0,0", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000",
           "--num-workers", "2", "--device", device, "--hidden-dropout", "0", "--attention-dropout", "0"]
    if device != "cpu":
        cmd.append("--bf16")
    cmd += extra.split()
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    lines = [parse_train_log_line(x) for x in proc.stdout.splitlines() if "] iteration " in x]
    steady = [d for d in lines if d["iteration"] > warmup]
    if proc.returncode or not steady:
        return {"row": "megatrain pretrain_bert.py", "error": (proc.stdout + proc.stderr)[-2000:]}
    ms = statistics.median(d["elapsed time per iteration (ms)"] for d in steady)
    return {"row": "megatrain pretrain_bert.py", "ms/iter": ms, "tokens/s": b * s / ms * 1e3,
            "peak GiB": max(d.get("peak mem (GiB)", 0.0) for d in steady), "wall s": time.time() - t0,
            "lm loss": steady[-1].get("lm loss"), "sop loss": steady[-1].get("sop loss")}


def run_transformers(kind: str, shape: str, iters: int, warmup: int, device: str) -> dict:
    import torch
    import transformers

    L, h, n, s, b = SHAPES[shape]
    common = dict(vocab_size=VOCAB, hidden_size=h, num_hidden_layers=L, num_attention_heads=n,
                  intermediate_size=4 * h, max_position_embeddings=s, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    if kind == "megatron":
        model = transformers.MegatronBertForPreTraining(transformers.MegatronBertConfig(**common))
        name = "transformers MegatronBertForPreTraining (eager attention)"
    else:
        cfg = transformers.BertConfig(**common, attn_implementation="sdpa")
        model = transformers.BertForPreTraining(cfg)
        name = "transformers BertForPreTraining (SDPA)"
    model.to(device).train()
    cuda = device != "cpu"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=cuda)
    step_model = torch.compile(model) if cuda else model
    g = torch.Generator().manual_seed(0)

    def batch():
        ids = torch.randint(104, VOCAB, (b, s), generator=g)
        labels = torch.where(torch.rand(b, s, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        types = (torch.arange(s) >= s // 2).long().expand(b, s)
        return {k: v.to(device) for k, v in dict(input_ids=ids, token_type_ids=types, labels=labels,
                                                 next_sentence_label=torch.randint(0, 2, (b,), generator=g),
                                                 attention_mask=torch.ones(b, s, dtype=torch.long)).items()}

    ms, peak, loss = timed_hf_steps(step_model, model, opt, [batch() for _ in range(4)], iters, warmup, cuda)
    del model, opt, step_model
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return {"row": name, "ms/iter": ms, "tokens/s": b * s / ms * 1e3, "peak GiB": peak, "loss": float(loss)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="bert-large", choices=sorted(SHAPES))
    ap.add_argument("--iters", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--peers", default="megatron,sdpa", help="transformers rows: megatron, sdpa (comma list)")
    ap.add_argument("--output", default=None, help="also write the table to this file")
    ap.add_argument("--extra", default="", help="more pretrain_bert.py flags for the megatrain row")
    a = ap.parse_args(argv)
    import torch

    peak = measure_matmul_peak() if a.device != "cpu" else None
    L, h, n, s, b = SHAPES[a.shape]
    padded_vocab = (VOCAB + 2 + 127) // 128 * 128  # the tokenizer's [BOS]/[EOS], padded as Megatron pads
    model_flops = flops(L, h, s, b, padded_vocab)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(run_megatrain(a.shape, a.iters, a.warmup, a.device, Path(tmp), a.timeout, a.extra))
    for peer in [p for p in a.peers.split(",") if p]:
        try:
            rows.append(run_transformers(peer, a.shape, a.iters, a.warmup, a.device))
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is a row saying why
            rows.append({"row": f"transformers {peer}", "error": f"{type(e).__name__}: {e}"[:500]})
    ours = rows[0].get("tokens/s")
    head = (f"BERT {a.shape} (L{L} H{h} {n} heads, seq {s}, micro-batch {b}), {a.device}"
            f"{' ' + torch.cuda.get_device_name() if a.device != 'cpu' else ''}, torch {torch.__version__}, "
            f"{datetime.date.today()}, {platform.node()}; bf16 matmul rate "
            f"{f'{peak:.1f} TFLOP/s' if peak else 'n/a'}; FLOPs/iteration {model_flops:.4g} (Megatron's formula)")
    out = [head, "", "| row | ms/iter | tokens/s | megatrain / row | TFLOP/s | of matmul rate | peak GiB |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['row']} | error: {r['error'].splitlines()[-1] if r['error'] else ''} |||||")
            continue
        tflops = model_flops / (r["ms/iter"] / 1e3) / 1e12
        ratio = f"{ours / r['tokens/s']:.2f}" if ours else "-"
        frac = f"{tflops / peak:.2f}" if peak else "-"
        out.append(f"| {r['row']} | {r['ms/iter']:.1f} | {r['tokens/s']:.0f} | {ratio} | {tflops:.1f} | {frac} | "
                   f"{r.get('peak GiB', 0.0):.1f} |")
    text = "\n".join(out)
    print(text)
    for r in rows:
        if "error" in r:
            print(f"\n{r['row']} failed:\n{r['error']}", file=sys.stderr)
    if a.output:
        Path(a.output).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
