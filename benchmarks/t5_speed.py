"""T5 pre-training speed side by side: ``pretrain_t5.py`` against Hugging Face transformers on the same
GPU, shape and batch, in one process tree of one device call. Prints a table.

    python benchmarks/t5_speed.py                               # T5-base 220M, micro-batch 64 (~5-6 min, one H200)
    python benchmarks/t5_speed.py --shape tiny --device cpu     # a smoke run anywhere (~15 s on 2 cores)

Rows (every row trains without dropout: the same work everywhere):

* megatrain, Megatron's example layout: the real ``pretrain_t5.py`` with the model and optimizer flags of
  Megatron-LM's ``examples/t5/train_t5_220m_distributed.sh`` (learned absolute positions, LayerNorm,
  biases, tied output layer with T5LMHead's bias; 12 + 12 layers, hidden 768, 12 heads, kv-channels 64,
  ffn 3072, encoder 512 / decoder 128 tokens, ``--vocab-extra-ids 100``, bf16, init std 0.015), micro-batch
  = global batch 64, one GPU, its defaults (whole-model torch.compile, fused AdamW on CUDA), on a
  sentence-level ``.bin/.idx`` dataset written here (documents of 16-40 sentences of random WordPiece ids
  over a generated 30522-entry ``vocab.txt``, about 1000 tokens a document, so a sample is a full
  510-token run of whole sentences before span corruption, but for Megatron's --short-seq-prob 0.1)
  with ``--split 100,0,0`` and no evaluation.
* megatrain, Hugging Face T5 layout: the same run with ``--position-embedding-type relative
  --normalization RMSNorm --disable-bias-linear`` (what ``T5ForConditionalGeneration`` computes, exact
  GELU; its attention runs through SDPA with the relative position bias and the padding as one
  [b, heads, s, s] float mask, as ``--attention-backend auto`` picks: each megatrain row's notes give
  pretrain_t5.py's start-up line on the attention path; the extra row ``hf-layout-flex`` runs it
  through FlexAttention instead, ``--attention-backend flex``: the bias as a score_mod, the padding as
  block masks) and
  ``--untie-embeddings-and-output-weights`` (T5 v1.1's untied head) where the installed transformers
  can untie T5's ``lm_head``. transformers 5.x (5.24 checked) always ties it to ``shared``
  and reads ``tie_word_embeddings=False`` only as "do not scale the decoder output", so with it both
  rows are tied (megatrain's tied head adds T5LMHead's bias, one [vocab] add; transformers scales by
  d_model**-0.5): the row names say which. This is the like-for-like row.
* transformers ``T5ForConditionalGeneration`` of that second layout (``feed_forward_proj="gelu"``,
  tied or untied as above, the padded vocabulary, dropout 0), SDPA attention where the installed
  transformers offers it for T5 (5.24 does: its relative position bias becomes SDPA's float mask;
  else eager; the row says which), ``torch.compile``, bf16 autocast, fused AdamW, grad clipping, on
  random batches of the same shapes (encoder input [64, 512], decoder input and labels [64, 128], all
  tokens attended). It runs in a child process of this script (``--hf-worker``), so a crash or a
  timeout is one row.

For every row: the median iteration time after the warm-up (megatrain's from its log lines),
tokens/s counting encoder + decoder tokens (micro-batch x (512 + 128) per iteration), the ratio of the
like-for-like megatrain row's tokens/s to the row's, TFLOP/s by megatrain's T5 formula
(``megatrain/models/t5/flops.py``: the same FLOPs for every row), that over the bf16 8192^3 matmul rate
measured first (CUDA only), and the peak allocated GPU memory.

Entry point for a device call (all rows on one GPU, inside one 10-minute call):
``python benchmarks/t5_speed.py --output $OUT/t5_speed.md`` (defaults ``--iters 12 --warmup 5``; every
row's process has its own ``--timeout``, 180 s, and every row prints a JSON line as it finishes, so a
call cut short still shows the rows done). ``--rows`` picks rows (``transformers-eager`` and
``hf-layout-flex`` add one each; ``hf-layout-mask`` runs the HF layout with
``MEGATRAIN_T5_BIAS_GRADIENT=mask``: SDPA's own gradient of the float mask, the default before 2026-12-07,
where ``hf-layout`` now recomputes the bias gradient apart with the Triton kernel on CUDA;
``hf-layout-recompute`` forces the recomputation; ``hf-layout-adamw-kernel`` forces AdamW through
megatrain's kernel (``MEGATRAIN_ADAMW_KERNEL=1``; the default at T5-base's size since 2026-12-07, so the
same as ``hf-layout`` there) and ``hf-layout-torch-adamw`` keeps torch's fused AdamW (``=0``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import (last_error_line, num, print_worker_result, rate_cells, run_worker,  # noqa: E402
                    timed_hf_steps, versions)
from throughput import measure_matmul_peak  # noqa: E402

# encoder layers, decoder layers, hidden, heads, kv-channels, ffn, encoder seq, decoder seq, micro-batch
SHAPES = {
    "t5-base": (12, 12, 768, 12, 64, 3072, 512, 128, 64),
    "tiny": (2, 2, 64, 4, 16, 256, 64, 32, 4),
}
VOCAB = 30522
EXTRA_IDS = 100
FIRST_ID = 104  # after [PAD], [unused0..98], [UNK], [CLS], [SEP], [MASK]
# The HF-expressible layout (megatrain/models/t5/hf.py: what exports to T5ForConditionalGeneration).
# Untied (--untie-embeddings-and-output-weights) where the installed transformers can untie T5's lm_head.
HF_LAYOUT = ["--position-embedding-type", "relative", "--normalization", "RMSNorm", "--disable-bias-linear"]


def write_vocab(path: Path) -> None:
    special = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = [f"w{i}" for i in range((VOCAB - len(special)) * 4 // 5)]
    pieces = [f"##p{i}" for i in range(VOCAB - len(special) - len(words))]
    path.write_text("\n".join(special + words + pieces) + "\n", encoding="utf-8")


def write_sentences(prefix: Path, tokens: int, seed: int = 0) -> None:
    """Documents of 16-40 sentences of 8-64 WordPiece ids each (ids of words and ## pieces): about
    1000 tokens a document, so the sample index's runs of whole sentences fill the encoder length."""
    import numpy as np

    from megatrain.data.indexed_dataset import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    written = 0
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        while written < tokens:
            lengths = rng.integers(8, 65, int(rng.integers(16, 41)))
            w.add_document(rng.integers(FIRST_ID, VOCAB, int(lengths.sum())), lengths=[int(n) for n in lengths])
            written += int(lengths.sum())


def padded_vocab(vocab_file: Path) -> int:
    """The vocabulary pretrain_t5.py trains with: the file's tokens, the sentinels, Megatron's padding."""
    from megatrain.data.tokenizers.wordpiece import BertWordPieceTokenizer
    from megatrain.training.builders import padded_vocab_size

    tok = BertWordPieceTokenizer(str(vocab_file), lower_case=False, vocab_extra_ids=EXTRA_IDS)
    return padded_vocab_size(tok.vocab_size, 128, 1)


def model_flops(shape: str, vocab: int) -> float:
    from megatrain.models.t5.config import T5Config
    from megatrain.models.t5.flops import num_floating_point_operations

    Le, Ld, h, n, d, F, se, sd, b = SHAPES[shape]
    cfg = T5Config(num_layers=Le, decoder_num_layers=Ld, hidden_size=h, num_attention_heads=n, kv_channels=d,
                   ffn_hidden_size=F, vocab_size=vocab, max_position_embeddings=max(se, sd), decoder_seq_length=sd)
    return num_floating_point_operations(cfg, b, se)


def transformers_unties() -> bool:
    """Whether ``T5ForConditionalGeneration`` with ``tie_word_embeddings=False`` has its own lm_head
    (transformers 4; transformers 5.24 always ties it to ``shared`` and reads the flag as
    ``scale_decoder_outputs`` only)."""
    import transformers

    tiny = transformers.T5Config(vocab_size=64, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
                                 tie_word_embeddings=False)
    model = transformers.T5ForConditionalGeneration(tiny)
    return model.lm_head.weight.data_ptr() != model.shared.weight.data_ptr()


def run_megatrain(name: str, shape: str, iters: int, warmup: int, device: str, tmp: Path, timeout: int,
                  extra: list[str], env: dict[str, str] | None = None) -> dict:
    from megatrain.training.logging import parse_train_log_line

    Le, Ld, h, n, d, F, se, sd, b = SHAPES[shape]
    # Megatron's example (T5_ARGS / DATA_ARGS), only the batch, iterations, parallelism and outputs changed.
    cmd = [sys.executable, "pretrain_t5.py", "--encoder-num-layers", str(Le), "--decoder-num-layers", str(Ld),
           "--hidden-size", str(h), "--num-attention-heads", str(n), "--kv-channels", str(d),
           "--ffn-hidden-size", str(F), "--encoder-seq-length", str(se), "--decoder-seq-length", str(sd),
           "--max-position-embeddings", str(max(se, sd)), "--micro-batch-size", str(b),
           "--global-batch-size", str(b), "--lr", "0.0001", "--train-iters", str(iters),
           "--lr-decay-iters", str(iters), "--lr-decay-style", "linear", "--min-lr", "0.00001",
           "--weight-decay", "1e-2", "--lr-warmup-fraction", ".01", "--clip-grad", "1.0",
           "--vocab-extra-ids", str(EXTRA_IDS), "--init-method-std", "0.015",
           "--transformer-impl", "transformer_engine", "--attention-backend", "auto",
           "--data-path", str(tmp / "bench_text_sentence"), "--vocab-file", str(tmp / "vocab.txt"),
           "--tokenizer-type", "BertWordPieceCase", "--split", "100,0,0",
           "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--device", device,
           # Megatron's default 2 loader workers (a T5 sample takes about 0.3 ms: 64 in ~20 ms); one on CPU
           "--num-workers", "2" if device != "cpu" else "1"]
    if device != "cpu":
        cmd.append("--bf16")
    cmd += extra
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"row": name, "error": f"{out[-1500:]}\ntimed out after {timeout} s (--timeout)"}
    lines = [parse_train_log_line(x) for x in proc.stdout.splitlines() if "] iteration " in x]
    steady = [r for r in lines if r["iteration"] > warmup]
    if proc.returncode or not steady:
        return {"row": name, "error": (proc.stdout + proc.stderr)[-2000:] or f"exit {proc.returncode}"}
    ms = statistics.median(r["elapsed time per iteration (ms)"] for r in steady)
    logged = [r[k] for r in steady for k in r if "TFLOP/s" in k]
    # pretrain_t5.py's start-up note on how attention runs (FlexAttention or SDPA; models/t5/config.py)
    attention = next((x.split("note: ", 1)[1] for x in proc.stdout.splitlines() if "note: T5 attention" in x), None)
    return {"row": name, "ms/iter": ms, "tokens/s": b * (se + sd) / ms * 1e3, "attention": attention,
            "peak GiB": max(r.get("peak mem (GiB)", 0.0) for r in steady), "wall s": time.time() - t0,
            "lm loss": steady[-1].get("lm loss"), "logged TFLOP/s": statistics.median(logged) if logged else None,
            "iterations": f"{steady[0]['iteration']}-{steady[-1]['iteration']}"}


def hf_worker(shape: str, iters: int, warmup: int, device: str, vocab: int, attn: str, untied: bool) -> dict:
    """One transformers row, in this (child) process."""
    import torch
    import transformers

    Le, Ld, h, n, d, F, se, sd, b = SHAPES[shape]
    cfg = dict(vocab_size=vocab, d_model=h, d_kv=d, d_ff=F, num_layers=Le, num_decoder_layers=Ld, num_heads=n,
               relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
               layer_norm_epsilon=1e-5, feed_forward_proj="gelu", tie_word_embeddings=not untied,
               is_encoder_decoder=True, pad_token_id=0, eos_token_id=102, decoder_start_token_id=101)
    wanted = [attn] if attn != "best" else ["sdpa", "eager"]
    model, why = None, []
    for impl in wanted:
        try:
            model = transformers.T5ForConditionalGeneration(transformers.T5Config(**cfg, attn_implementation=impl))
            break
        except (ValueError, ImportError) as e:  # transformers refuses an implementation T5 lacks
            why.append(f"{impl}: {str(e).splitlines()[0][:120]}")
    if model is None:
        raise RuntimeError("; ".join(why))
    impl = model.config._attn_implementation
    tied = model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr()
    if tied == untied:
        raise RuntimeError(f"asked for an {'un' if untied else ''}tied lm_head, transformers built a "
                           f"{'' if tied else 'un'}tied one")
    cuda = device != "cpu"
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=cuda)
    step_model = torch.compile(model) if cuda else model
    g = torch.Generator().manual_seed(0)

    def batch():
        return {k: v.to(device) for k, v in dict(
            input_ids=torch.randint(FIRST_ID, VOCAB, (b, se), generator=g),
            attention_mask=torch.ones(b, se, dtype=torch.long),
            decoder_input_ids=torch.randint(FIRST_ID, VOCAB, (b, sd), generator=g),
            decoder_attention_mask=torch.ones(b, sd, dtype=torch.long),
            labels=torch.randint(FIRST_ID, VOCAB, (b, sd), generator=g)).items()}

    ms, peak, loss = timed_hf_steps(step_model, model, opt, [batch() for _ in range(4)], iters, warmup, cuda)
    note = "" if impl == "sdpa" or attn != "best" else f"; no SDPA: {'; '.join(why)}"
    layout = "untied" if untied else "tied, decoder output scaled by d_model**-0.5"
    return {"row": f"transformers T5ForConditionalGeneration ({impl} attention{note}; {layout})", "ms/iter": ms,
            "tokens/s": b * (se + sd) / ms * 1e3, "peak GiB": peak, "lm loss": float(loss),
            "iterations": f"{warmup + 1}-{iters}", "transformers": transformers.__version__}


def run_transformers(shape: str, iters: int, warmup: int, device: str, vocab: int, attn: str, untied: bool,
                     timeout: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--hf-worker", "--shape", shape, "--iters", str(iters),
           "--warmup", str(warmup), "--device", device, "--vocab", str(vocab), "--attn", attn]
    cmd += ["--untied"] if untied else []
    name = f"transformers T5ForConditionalGeneration ({attn})"
    return run_worker(cmd, REPO, name, timeout)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="t5-base", choices=sorted(SHAPES))
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=5, help="iterations left out of the median (compilation)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--timeout", type=int, default=180, help="seconds for each row's process")
    ap.add_argument("--rows", default="example,hf-layout,transformers",
                    help="comma list of: example, hf-layout (megatrain rows), transformers (--attn), "
                         "transformers-eager (an extra row with eager attention), hf-layout-flex (an extra "
                         "megatrain HF-layout row with FlexAttention instead of SDPA), hf-layout-mask and "
                         "hf-layout-recompute (extra HF-layout rows with MEGATRAIN_T5_BIAS_GRADIENT=mask or "
                         "=recompute), hf-layout-adamw-kernel / hf-layout-torch-adamw (MEGATRAIN_ADAMW_KERNEL=1 / 0)")
    ap.add_argument("--attn", default="best", choices=["best", "sdpa", "eager", "flex_attention"],
                    help="transformers' attn_implementation (best: SDPA if T5 offers it, else eager)")
    ap.add_argument("--output", default=None, help="also write the table to this file")
    ap.add_argument("--extra", default="", help="more pretrain_t5.py flags for both megatrain rows")
    ap.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--untied", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.warmup >= a.iters:
        ap.error(f"--warmup ({a.warmup}) must be below --iters ({a.iters})")
    if a.hf_worker:
        result = hf_worker(a.shape, a.iters, a.warmup, a.device, a.vocab, a.attn, a.untied)
        print_worker_result(result)
        return
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu)")
    wanted = [r for r in a.rows.split(",") if r]
    try:
        untied = transformers_unties()
    except ImportError:
        untied = True  # no transformers row; T5 v1.1's untied layout
    peak = measure_matmul_peak() if a.device != "cpu" else None
    if peak:
        torch.cuda.empty_cache()  # the matmul's operands: leave the GPU to the rows' processes
        print(f"bf16 8192^3 matmul: {peak:.1f} TFLOP/s", flush=True)
    Le, Ld, h, n, d, F, se, sd, b = SHAPES[a.shape]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_vocab(tmp / "vocab.txt")
        vocab = padded_vocab(tmp / "vocab.txt")
        flops = model_flops(a.shape, vocab)
        write_sentences(tmp / "bench_text_sentence", tokens=(a.iters + 4) * b * se * 2)
        megatrain_rows = {
            "example": ("megatrain pretrain_t5.py, Megatron's example layout (learned_absolute, LayerNorm, "
                        "biases, tied)", []),
            "hf-layout": ("megatrain pretrain_t5.py, HF T5 layout (relative, RMSNorm, no biases, "
                          + ("untied)" if untied else "tied as this transformers' T5 always is)"),
                          HF_LAYOUT + (["--untie-embeddings-and-output-weights"] if untied else [])),
            # not a default row: the same HF layout through FlexAttention (the bias as a score_mod)
            "hf-layout-flex": ("megatrain pretrain_t5.py, HF T5 layout, FlexAttention (--attention-backend flex)",
                               HF_LAYOUT + (["--untie-embeddings-and-output-weights"] if untied else [])
                               + ["--attention-backend", "flex"]),
            # not default rows: the bias gradient forced to SDPA's mask gradient, or to the recomputation
            "hf-layout-mask": ("megatrain pretrain_t5.py, HF T5 layout, MEGATRAIN_T5_BIAS_GRADIENT=mask",
                               HF_LAYOUT + (["--untie-embeddings-and-output-weights"] if untied else [])),
            "hf-layout-recompute": ("megatrain pretrain_t5.py, HF T5 layout, MEGATRAIN_T5_BIAS_GRADIENT=recompute",
                                    HF_LAYOUT + (["--untie-embeddings-and-output-weights"] if untied else [])),
            # not a default row: AdamW through megatrain's kernel (T5-base is below its default size)
            "hf-layout-adamw-kernel": ("megatrain pretrain_t5.py, HF T5 layout, MEGATRAIN_ADAMW_KERNEL=1",
                                       HF_LAYOUT + (["--untie-embeddings-and-output-weights"] if untied else [])),
            "hf-layout-torch-adamw": ("megatrain pretrain_t5.py, HF T5 layout, MEGATRAIN_ADAMW_KERNEL=0",
                                      HF_LAYOUT + (["--untie-embeddings-and-output-weights"] if untied else [])),
        }
        envs = {"hf-layout-mask": {"MEGATRAIN_T5_BIAS_GRADIENT": "mask"},
                "hf-layout-recompute": {"MEGATRAIN_T5_BIAS_GRADIENT": "recompute"},
                "hf-layout-adamw-kernel": {"MEGATRAIN_ADAMW_KERNEL": "1"},
                "hf-layout-torch-adamw": {"MEGATRAIN_ADAMW_KERNEL": "0"}}
        for key in [r for r in wanted if r in megatrain_rows]:
            name, flags = megatrain_rows[key]
            rows.append(run_megatrain(name, a.shape, a.iters, a.warmup, a.device, tmp, a.timeout,
                                      flags + a.extra.split(), env=envs.get(key)))
            rows[-1]["key"] = key
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "error"}), flush=True)
    for key, attn in (("transformers", a.attn), ("transformers-eager", "eager")):
        if key in wanted:
            rows.append(run_transformers(a.shape, a.iters, a.warmup, a.device, vocab, attn, untied, a.timeout))
            rows[-1]["key"] = key
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "error"}), flush=True)
    ref = next((r.get("tokens/s") for r in rows if r.get("key") == "hf-layout"), None)
    head = (f"T5 {a.shape} ({Le}+{Ld} layers, hidden {h}, {n} heads x {d}, ffn {F}, encoder {se} / decoder {sd} "
            f"tokens, micro-batch = global batch {b}, padded vocab {vocab}), {a.device}"
            f"{' ' + torch.cuda.get_device_name() if a.device != 'cpu' else ''}, {datetime.date.today()}; "
            f"{versions()}; bf16 8192^3 matmul rate {f'{peak:.1f} TFLOP/s' if peak else 'n/a'}; "
            f"FLOPs/iteration {flops:.4g} (megatrain/models/t5/flops.py, the same for every row); tokens/s count "
            f"encoder + decoder tokens ({b} x ({se} + {sd}) per iteration); medians of iterations "
            f"{a.warmup + 1}-{a.iters}; ratio = the megatrain HF-layout row's tokens/s over the row's")
    out = [head, "", "| row | ms/iter | tokens/s | megatrain (HF layout) / row | TFLOP/s | of matmul rate | peak GiB |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['row']} | error: {last_error_line(r)} |||||")
            continue
        tflops, frac, mem = rate_cells(r, flops, peak, a.device)
        ratio = f"{ref / r['tokens/s']:.2f}" if ref else "-"
        out.append(f"| {r['row']} | {r['ms/iter']:.1f} | {r['tokens/s']:.0f} | {ratio} | {num(tflops)} | {frac} | "
                   f"{mem} |")
    notes = [f"- {r['row']}: lm loss {r['lm loss']:.3f} at the last iteration"
             + (f", TFLOP/s logged by pretrain_t5.py {num(r['logged TFLOP/s'])}"
                if r.get("logged TFLOP/s") is not None else "")
             + (f", wall {r['wall s']:.0f} s" if r.get("wall s") else "")
             + (f"; {r['attention']}" if r.get("attention") else "")
             for r in rows if "error" not in r and r.get("lm loss") is not None]
    text = "\n".join(out + ([""] + notes if notes else []))
    print(text)
    for r in rows:
        if "error" in r:
            print(f"\n{r['row']} failed:\n{r['error']}", file=sys.stderr)
    if a.output:
        Path(a.output).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
