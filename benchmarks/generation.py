"""Generation throughput with random weights: `generate`, the engine, and transformers as a peer.

    python benchmarks/generation.py                                   # 1.7B and llama-1.2b, batch 1/16/64, CUDA
    python benchmarks/generation.py --shape tiny --device cpu --batch-sizes 1 4 --new-tokens 16   # smoke test
    python benchmarks/generation.py --shape llama-tiny --device cpu --batch-sizes 2 --new-tokens 8 --rows all
    python benchmarks/generation.py --output gen.md                   # also write the markdown table

Rows (``--rows``; default all of them on CUDA, ``generate engine`` on the CPU; ``hf`` only for LLaMA shapes):

- ``generate``: `megatrain.inference.generation.generate` (left-padded batch, growing KV cache), greedy.
- ``engine``: the engine (`megatrain.inference.engine`: slot cache, continuous batching, CUDA graphs
  on CUDA), the batch's jobs admitted in one step, greedy; ``engine-compile``: the same with its
  decode forward through torch.compile (``EngineConfig.compile_decode``); ``engine-compile-stepwise``:
  that with ``EngineConfig.lookahead`` off (the host reads each step's tokens before the next launch).
- ``replay``, ``replay-compile``: the engine's runner alone, its decode steps replayed back to back
  with no host work between them (the device's time per step; the engine row less this one is the
  engine's host work per step). The compiled rows use the engine's default (``gemv_tuning``: Inductor's
  coordinate-descent tuning, batch-1 matmuls as tuned reductions); ``replay-compile-cublas`` and
  ``engine-compile-cublas`` compile without it (the batch-1 matmuls in cuBLAS). ``replay-autotune``:
  replay-compile with the decode compiled in ``max-autotune-no-cudagraphs`` mode (Inductor's autotuned
  matmul templates).
- ``hf``, ``hf-compile``: transformers' `LlamaForCausalLM` of the same shape (random weights, built from
  a config offline) `generate(cache_implementation="static")`, eager and with its compiled decode
  (transformers compiles the forward of a static-cache generation unless ``disable_compile``); each
  run in its own process (``--hf-timeout``).

For each batch size: a prefill of ``--prompt-tokens`` tokens per sequence, then ``--new-tokens`` decode
steps (no early stop). Reported: time to the first token, decode tokens/s over all sequences, per-step
latency, peak memory, and on CUDA the bandwidth floor: the decode tokens/s if a step only had to read
the weights once plus every sequence's keys and values (at the mean context of the decode), at the
rate of a large device-to-device copy measured in the same run (bytes read + written per second),
and the row's share of it. Median of ``--repeats`` runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import os
import datetime
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import cpu_model, emit_table, print_worker_result, run_worker  # noqa: E402
from megatrain.inference.engine.api import GenerateJob, Sampling, TokenEvent  # noqa: E402
from megatrain.inference.engine.engine import EngineConfig, GenerationEngine  # noqa: E402
from megatrain.inference.generation import generate  # noqa: E402
from megatrain.models.gpt import GPTModel  # noqa: E402
from megatrain.models.gpt.config import GPTConfig  # noqa: E402

_LLAMA = dict(swiglu=True, position_embedding_type="rope", normalization="RMSNorm",
              untie_embeddings_and_output_weights=True, add_bias_linear=False)
SHAPES = {
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, max_position_embeddings=512),
    "llama-tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                       vocab_size=512, max_position_embeddings=512, **_LLAMA),
    # The training benchmark's 1.7B shape (guide §4): L24 H2048 16 heads, vocab 131072.
    "1.7b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=131072,
                 max_position_embeddings=4096),
    "llama-1.2b": dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
                       ffn_hidden_size=8192, vocab_size=128256, max_position_embeddings=4096, **_LLAMA),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROWS = ("generate", "engine", "engine-compile", "engine-compile-cublas", "engine-compile-stepwise", "replay",
        "replay-compile", "replay-compile-cublas", "replay-autotune", "hf", "hf-compile")


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


def prompts_for(batch: int, prompt_tokens: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab, (batch, prompt_tokens), generator=g).tolist()


def median_of(fn, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


# ---- rows -----------------------------------------------------------------------------------------

def measure_generate(model, prompts, new_tokens: int, repeats: int, device: torch.device) -> dict[str, float]:
    def timed(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        out = generate(model, prompts, n)
        sync(device)
        assert all(len(o) == n for o in out)
        return time.perf_counter() - t0

    timed(2)  # warm-up (kernels, allocator)
    prefill = median_of(lambda: timed(1), repeats)
    total = median_of(lambda: timed(new_tokens), repeats)
    decode = max(total - prefill, 1e-9)
    return {"ttft_ms": prefill * 1e3, "step_ms": decode / (new_tokens - 1) * 1e3,
            "decode_tok_s": len(prompts) * (new_tokens - 1) / decode}


_HOLD: dict[str, threading.Event] = {}


def _hold(model, payload) -> None:
    """Registered as "hold": keeps the engine thread between steps until the gate opens."""
    _HOLD["entered"].set()
    _HOLD["gate"].wait()


def engine_run(engine: GenerationEngine, prompts, new_tokens: int) -> tuple[float, float]:
    """All jobs admitted in one step (they are submitted while the engine thread is held in a call):
    (seconds to the last job's first token, decode seconds from there to the last token)."""
    first: list[float] = []
    last = [0.0]
    remaining = [len(prompts)]
    done = threading.Event()

    def listener():
        seen = [False]

        def on_event(event: TokenEvent) -> None:  # called on the engine thread only
            now = time.perf_counter()
            if not seen[0]:
                seen[0] = True
                first.append(now)
            if event.finish_reason is not None:
                assert event.finish_reason == "length", event
                last[0] = max(last[0], now)
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()
        return on_event

    _HOLD.update(gate=threading.Event(), entered=threading.Event())
    held = engine.call("hold", {})
    _HOLD["entered"].wait()
    for prompt in prompts:
        engine.submit(GenerateJob(prompt, new_tokens, Sampling(greedy=True)), listener())
    start = time.perf_counter()
    _HOLD["gate"].set()
    held.result()
    done.wait()
    return max(first) - start, last[0] - max(first)


def measure_engine(model, prompts, new_tokens: int, repeats: int, max_requests: int,
                   compile_decode: bool = False, lookahead: bool = True,
                   gemv_tuning: bool = True) -> dict[str, float]:
    config = EngineConfig(max_requests=max_requests, max_sequence_length=len(prompts[0]) + new_tokens,
                          max_waiting=0, compile_decode=compile_decode, lookahead=lookahead,
                          gemv_tuning=gemv_tuning)
    engine = GenerationEngine(model, config)
    engine.register("hold", _hold)
    try:
        engine_run(engine, prompts, new_tokens)  # warm-up (and the CUDA graphs it needs)
        runs = [engine_run(engine, prompts, new_tokens) for _ in range(repeats)]
    finally:
        engine.close()
    ttft = statistics.median(r[0] for r in runs)
    decode = max(statistics.median(r[1] for r in runs), 1e-9)
    return {"ttft_ms": ttft * 1e3, "step_ms": decode / (new_tokens - 1) * 1e3,
            "decode_tok_s": len(prompts) * (new_tokens - 1) / decode}


def hf_worker(argv: list[str]) -> None:
    """``--hf-worker MODE SHAPE DTYPE DEVICE BATCH PROMPT NEW REPEATS``: one transformers row, printed as a result."""
    mode, shape, dtype, device = argv[0], argv[1], DTYPES[argv[2]], torch.device(argv[3])
    batch, prompt_tokens, new_tokens, repeats = map(int, argv[4:8])
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[shape]
    config = LlamaConfig(hidden_size=s["hidden_size"], intermediate_size=s["ffn_hidden_size"],
                         num_hidden_layers=s["num_layers"], num_attention_heads=s["num_attention_heads"],
                         num_key_value_heads=s.get("num_query_groups", s["num_attention_heads"]),
                         vocab_size=s["vocab_size"], max_position_embeddings=s["max_position_embeddings"],
                         tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.tensor(prompts_for(batch, prompt_tokens, s["vocab_size"]), device=device)

    def timed(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, cache_implementation="static",
                                 disable_compile=mode != "hf-compile", pad_token_id=0)
        sync(device)
        assert out.shape[1] == prompt_tokens + n
        return time.perf_counter() - t0

    timed(new_tokens)  # warm-up (the compile for hf-compile)
    prefill = median_of(lambda: timed(1), repeats)
    total = median_of(lambda: timed(new_tokens), repeats)
    decode = max(total - prefill, 1e-9)
    print_worker_result({"ttft_ms": prefill * 1e3, "step_ms": decode / (new_tokens - 1) * 1e3,
                         "decode_tok_s": batch * (new_tokens - 1) / decode,
                         "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None})


# ---- the bandwidth floor ----------------------------------------------------------------------------

def copy_rate(device: torch.device, gib: float = 2.0) -> float:
    """Bytes read + written per second of a large device-to-device copy (median of 10)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * gib * 2**30 / statistics.median(times)


def step_bytes(model: GPTModel, batch: int, context: float) -> float:
    """Bytes one decode step must read: every weight once (the input embedding only as rows, when the
    output layer has its own weight) plus each sequence's keys and values at ``context`` tokens."""
    c = model.config
    element = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters()) * element
    if model.output_layer is not None:
        weights -= model.embedding.word_embeddings.weight.numel() * element
    kv = 2 * c.num_layers * c.num_query_groups * c.kv_channels * element * context * batch
    return weights + kv


# ---- the table -------------------------------------------------------------------------------------

def measure_replay(model, prompts, new_tokens: int, repeats: int, compile_decode: bool = False,
                   compile_mode: str | None = None, gemv_tuning: bool = True,
                   profile_path: str | None = None) -> dict[str, float]:
    """The engine's own runner (slot cache, CUDA graphs) driven by the least host work there is: the
    prompts prefilled once, then ``new_tokens - 1`` decode steps replayed back to back with the tokens
    the first step chose, one synchronisation at the end. Its step time is what the device needs per
    step; the engine row's step time less this one is the engine's host work between steps."""
    from megatrain.inference.engine.runner import ModelRunner
    from megatrain.inference.engine.slot_cache import CacheShape, SlotKVCache
    from megatrain.models.common.attention import SelfAttention

    device = next(model.parameters()).device
    config = model.config
    layers = tuple(m.layer_number for m in model.modules() if isinstance(m, SelfAttention))
    length = len(prompts[0]) + new_tokens
    cache = SlotKVCache(CacheShape(layers, config.num_query_groups, config.kv_channels, len(prompts), length),
                        next(model.parameters()).dtype, device)
    runner = ModelRunner(model, cache, device, cuda_graphs=device.type == "cuda", compile_decode=compile_decode,
                         compile_mode=compile_mode, gemv_tuning=gemv_tuning)
    with torch.inference_mode():
        tokens = runner.prefill(list(enumerate(prompts))).argmax(-1).tolist()

        def timed(steps: int) -> float:
            sync(device)
            t0 = time.perf_counter()
            for step in range(steps):
                position = len(prompts[0]) + step
                runner.decode(tokens, [position] * len(prompts), position + 1)
            sync(device)
            return time.perf_counter() - t0

        timed(new_tokens - 1)  # warm-up: every graph the steps need
        decode = max(median_of(lambda: timed(new_tokens - 1), repeats), 1e-9)
        if profile_path is not None:  # the same steps under the profiler: its kernels, inside the graphs too
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                timed(new_tokens - 1)
            os.makedirs(os.path.dirname(profile_path) or ".", exist_ok=True)
            prof.export_chrome_trace(profile_path)
    return {"ttft_ms": float("nan"), "step_ms": decode / (new_tokens - 1) * 1e3,
            "decode_tok_s": len(prompts) * (new_tokens - 1) / decode}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--hf-worker":
        hf_worker(argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=["1.7b", "llama-1.2b"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", nargs="+", choices=ROWS + ("all",), default=None,
                   help="default: all of them on CUDA, generate and engine on the CPU")
    p.add_argument("--hf-timeout", type=int, default=900, help="seconds for one transformers row (its process)")
    p.add_argument("--profile-dir", default=None,
                   help="replay rows: also write a profiler trace of one run of the steps there "
                        "(read it with benchmarks/trace_kernels.py --iterations NEW_TOKENS-1)")
    p.add_argument("--output", default=None, help="also write the markdown table to this file")
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2")
    device = torch.device(args.device)
    if args.rows is None:
        args.rows = list(ROWS) if device.type == "cuda" else ["generate", "engine"]
    rows = list(ROWS) if "all" in args.rows else args.rows
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; pass --device cpu (with --shape tiny) for a smoke test")
    rate = copy_rate(device) if device.type == "cuda" else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    lines = [f"### Generation throughput, {args.dtype}, greedy, random weights", "",
             f"{datetime.date.today()} · {name} · torch {torch.__version__} · prompt {args.prompt_tokens} tokens, "
             f"{args.new_tokens} new tokens, median of {args.repeats}"
             + (f" · device-to-device copy {rate / 1e12:.2f} TB/s (read + write)" if rate else ""), "",
             "| shape | row | batch | time to first token (ms) | decode tokens/s | ms per decode step "
             "| bandwidth floor tokens/s | of floor | peak memory (GiB) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for shape in args.shape:
        model = build_model(shape, device, DTYPES[args.dtype])
        llama = SHAPES[shape].get("swiglu", False)
        context = args.prompt_tokens + args.new_tokens / 2
        for row in rows:
            if row.startswith("hf") and not llama:
                continue
            for batch in args.batch_sizes:
                prompts = prompts_for(batch, args.prompt_tokens, model.config.vocab_size)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                if row == "generate":
                    r = measure_generate(model, prompts, args.new_tokens, args.repeats, device)
                elif row.startswith("replay"):
                    trace = (os.path.join(args.profile_dir, f"{row}_{shape}_b{batch}.json.gz")
                             if args.profile_dir else None)
                    r = measure_replay(model, prompts, args.new_tokens, args.repeats,
                                       compile_decode=row != "replay", profile_path=trace,
                                       compile_mode="max-autotune-no-cudagraphs" if row == "replay-autotune" else None,
                                       gemv_tuning=not row.endswith("cublas"))
                elif row.startswith("engine"):
                    r = measure_engine(model, prompts, args.new_tokens, args.repeats, max(args.batch_sizes),
                                       compile_decode=row.startswith("engine-compile"),
                                       lookahead=not row.endswith("stepwise"),
                                       gemv_tuning=not row.endswith("cublas"))
                else:
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--hf-worker", row, shape, args.dtype,
                           args.device, str(batch), str(args.prompt_tokens), str(args.new_tokens), str(args.repeats)]
                    r = run_worker(cmd, REPO, row, args.hf_timeout)
                if "error" in r:
                    lines.append(f"| {shape} | {row} | {batch} | error: {r['error'][-300:]!r} | | | | | |")
                    print(lines[-1], flush=True)
                    continue
                peak = r.get("peak_gib")
                if peak is None and device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated(device) / 2**30
                floor = batch / (step_bytes(model, batch, context) / rate) if rate else None
                floor_text = f"{floor:.0f}" if floor else "-"
                share = f"{r['decode_tok_s'] / floor:.0%}" if floor else "-"
                peak_text = f"{peak:.2f}" if peak is not None else "-"
                ttft = "-" if r["ttft_ms"] != r["ttft_ms"] else f"{r['ttft_ms']:.1f}"  # nan: the row has none
                lines.append(f"| {shape} | {row} | {batch} | {ttft} | {r['decode_tok_s']:.1f} | "
                             f"{r['step_ms']:.2f} | {floor_text} | {share} | {peak_text} |")
                print(lines[-1], flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    lines.append(f"\nCommand: `python benchmarks/generation.py {' '.join(argv)}`")
    emit_table(lines, args.output)


if __name__ == "__main__":
    main()
