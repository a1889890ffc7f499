"""Generation throughput of `megatrain.inference.generation.generate` (KV cache, greedy) with random weights.

    python benchmarks/generation.py                          # the 1.7B shape, batch 1 and 16, on CUDA
    python benchmarks/generation.py --shape tiny --device cpu --batch-sizes 1 4 --new-tokens 16   # smoke test
    python benchmarks/generation.py --output gen.md          # also write the markdown table

For each batch size: a prefill of ``--prompt-tokens`` tokens per sequence, then ``--new-tokens``
decode steps (no early stop). Reported: time to the first token (prefill), decode tokens/s over all
sequences, per-step latency, end-to-end new tokens/s, and peak memory. Median of ``--repeats`` runs
after one warm-up run.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatrain.inference.generation import generate  # noqa: E402
from megatrain.models.gpt.config import GPTConfig  # noqa: E402
from megatrain.models.gpt import GPTModel  # noqa: E402

SHAPES = {
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, max_position_embeddings=512),
    # The training benchmark's 1.7B shape (guide §4): L24 H2048 16 heads, vocab 131072.
    "1.7b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=131072,
                 max_position_embeddings=4096),
    "llama-1.2b": dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8, swiglu=True,
                       ffn_hidden_size=8192, position_embedding_type="rope", normalization="RMSNorm",
                       untie_embeddings_and_output_weights=True, add_bias_linear=False, vocab_size=128256,
                       max_position_embeddings=4096),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_model(shape: str, device: torch.device, dtype: torch.dtype) -> GPTModel:
    config = GPTConfig(**SHAPES[shape], hidden_dropout=0.0, attention_dropout=0.0)
    with torch.device("meta"):
        model = GPTModel(config)
    model.to_empty(device=device)
    with torch.no_grad():  # random weights, drawn on the device (fast); norms stay at 1 / 0
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    return model.to(dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, prompts, new_tokens: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    out = generate(model, prompts, new_tokens)
    sync(device)
    assert all(len(o) == new_tokens for o in out)
    return time.perf_counter() - t0


def measure(model, batch: int, prompt_tokens: int, new_tokens: int, repeats: int, device: torch.device,
            vocab: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, prompt_tokens), generator=g).tolist()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed_generate(model, prompts, 2, device)  # warm-up (kernels, allocator)
    prefill = statistics.median(timed_generate(model, prompts, 1, device) for _ in range(repeats))
    total = statistics.median(timed_generate(model, prompts, new_tokens, device) for _ in range(repeats))
    decode = max(total - prefill, 1e-9)
    return {
        "batch": batch,
        "ttft_ms": prefill * 1e3,
        "decode_tok_s": batch * (new_tokens - 1) / decode,
        "step_ms": decode / (new_tokens - 1) * 1e3,
        "e2e_tok_s": batch * new_tokens / total,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan"),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--output", default=None, help="also write the markdown table to this file")
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; pass --device cpu (with --shape tiny) for a smoke test")
    model = build_model(args.shape, device, DTYPES[args.dtype])
    rows = [measure(model, b, args.prompt_tokens, args.new_tokens, args.repeats, device, model.config.vocab_size)
            for b in args.batch_sizes]

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    lines = [
        f"### Generation throughput, shape {args.shape} ({model.num_parameters() / 1e9:.2f}B parameters), "
        f"{args.dtype}, greedy with KV cache",
        "",
        f"{datetime.date.today()} · {name} · torch {torch.__version__} · prompt {args.prompt_tokens} tokens, "
        f"{args.new_tokens} new tokens, median of {args.repeats}",
        "",
        "| batch | time to first token (ms) | decode tokens/s | ms per decode step | end-to-end new tokens/s "
        "| peak memory (GiB) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['ttft_ms']:.1f} | {r['decode_tok_s']:.1f} | {r['step_ms']:.2f} | "
                     f"{r['e2e_tok_s']:.1f} | {r['peak_gib']:.2f} |")
    lines.append(f"\nCommand: `python benchmarks/generation.py {' '.join(argv if argv is not None else sys.argv[1:])}`")
    table = "\n".join(lines)
    print(table, flush=True)
    if args.output:
        Path(args.output).write_text(table + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
