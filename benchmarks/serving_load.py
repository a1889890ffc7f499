"""Serving load: the HTTP server (``megatrain.inference.server``) under one client, then many at once.

    python benchmarks/serving_load.py                                  # llama-1.2b, CUDA, 64 clients for 60 s
    python benchmarks/serving_load.py --shape tiny --device cpu --clients 8 --requests-per-client 2 --max-new-tokens 16   # smoke test
    python benchmarks/serving_load.py --shape llama-1.2b --clients 64 --duration 60 --compile-decode
    python benchmarks/serving_load.py --output serving.md              # also write the markdown table

A random-weight GPTModel of ``--shape`` (the shapes of ``benchmarks/generation.py``; bf16 on CUDA, fp32
on the CPU) is served in-process on a free port of 127.0.0.1: the batching engine with ``--max-requests``
slots (CUDA graphs on CUDA, as the server builds it; ``--compile-decode``: its decode forward through
torch.compile) behind the FastAPI/uvicorn app. The tokenizer is a NullTokenizer (text is space-separated
ids) whose end token is the model's last id; that token's embedding and output rows are zeroed, so its
logit is exactly 0 and greedy decoding (almost surely) never picks it: every request generates its full
``max_tokens``, and the output tokens counted are the server's own ``usage.completion_tokens``.

The clients run in their own process (``--client-worker``: the standard library's ``http.client`` in
threads, one connection per request), so their parsing does not take the server's GIL. Every request
is a streamed ``POST /v1/completions`` (``"stream": true``, ``"prompt"``: token ids, ``"temperature": 0``,
``stream_options.include_usage``). Time to first token: from sending the request to the first chunk
with text; per-token latency: (last chunk - first chunk) / (output tokens - 1).

1. One client: ``--single-requests`` requests one after another, ``--prompt-tokens`` prompt tokens and
   ``--max-new-tokens`` new tokens each.
2. ``--clients`` concurrent clients, each sending requests back to back with prompt lengths uniform in
   ``--min-prompt-tokens..--max-prompt-tokens`` and ``max_tokens`` uniform in
   ``--min-new-tokens..--max-new-tokens`` (seeded by ``--seed``), for ``--duration`` seconds (no new
   request after it) or ``--requests-per-client`` requests each.

Reported: output tokens/s (all output tokens over the phase's wall time: from the clients' start to the
last answer, so the drain after ``--duration`` counts), its ratio to the one-client
rate, p50/p99 time to first token, p50 per-token latency, and the failed requests (HTTP errors, 503s,
error events, connection failures) and the short ones (fewer output tokens than ``max_tokens``). Before
the measured phases a warm-up (one request alone, then one short request per client at once) captures
the CUDA graphs and compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import http.client
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULT_PREFIX = "RESULT "  # benchmarks.common's, without importing it (nor torch) in the client process


# ---------------------------------------------------------------- clients (their own process, no torch)

def one_request(port: int, prompt: list[int], max_tokens: int, timeout: float) -> dict[str, Any]:
    """One streamed completion; its timings (perf_counter seconds) and outcome."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    rec: dict[str, Any] = {"prompt_tokens": len(prompt), "max_tokens": max_tokens, "ok": False, "status": None,
                           "error": None, "completion_tokens": 0, "ttft": None, "last": None}
    start = time.perf_counter()
    rec["start"] = start
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        rec["status"] = resp.status
        if resp.status != 200:
            rec["error"] = f"HTTP {resp.status}: {resp.read()[:200].decode(errors='replace')}"
            return rec
        done = False
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            now = time.perf_counter()
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                rec["error"] = f"error event: {event['error'].get('message', '')[:200]}"
                return rec
            if event.get("usage"):
                rec["completion_tokens"] = int(event["usage"]["completion_tokens"])
            for choice in event.get("choices", []):
                if choice.get("text"):
                    if rec["ttft"] is None:
                        rec["ttft"] = now - start
                    rec["last"] = now - start
        if not done:
            rec["error"] = "the stream ended before [DONE]"
            return rec
        rec["ok"] = True
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        rec["error"] = f"{type(e).__name__}: {e}"[:200]
    finally:
        rec["end"] = time.perf_counter()
        conn.close()
    return rec


def client_worker() -> None:
    """``--client-worker``: run the phase described by the JSON on stdin; print its records."""
    spec = json.loads(sys.stdin.read())
    port, clients, timeout = spec["port"], spec["clients"], spec["timeout"]
    eod = spec["eod"]  # prompt ids are drawn from 0..eod-1
    records: list[list[dict[str, Any]]] = [[] for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)
    deadline: list[float] = [0.0]

    def client(i: int) -> None:
        rng = random.Random(spec["seed"] * 100003 + i)
        barrier.wait()
        n = 0
        while True:
            if spec["requests"] is not None and n >= spec["requests"]:
                break
            if spec["duration"] is not None and time.perf_counter() >= deadline[0]:
                break
            plen = rng.randint(*spec["prompt_tokens"])
            max_tokens = rng.randint(*spec["max_tokens"])
            prompt = [rng.randrange(eod) for _ in range(plen)]
            records[i].append(one_request(port, prompt, max_tokens, timeout))
            n += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    if spec["duration"] is not None:
        deadline[0] = t0 + spec["duration"]
    barrier.wait()
    for t in threads:
        t.join()
    t1 = time.perf_counter()
    flat = [dict(r, client=i) for i, rs in enumerate(records) for r in rs]
    print(RESULT_PREFIX + json.dumps({"t0": t0, "t1": t1, "records": flat}), flush=True)


def run_phase(port: int, eod: int, clients: int, prompt_tokens: tuple[int, int], max_tokens: tuple[int, int],
              requests: int | None, duration: float | None, seed: int, timeout: float) -> dict[str, Any]:
    spec = dict(port=port, eod=eod, clients=clients, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                requests=requests, duration=duration, seed=seed, timeout=timeout)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--client-worker"], input=json.dumps(spec),
                          capture_output=True, text=True, cwd=REPO)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
    if proc.returncode or not lines:
        raise SystemExit(f"the client process failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


# ---------------------------------------------------------------- statistics

def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(phase: dict[str, Any]) -> dict[str, Any]:
    recs = phase["records"]
    ok = [r for r in recs if r["ok"]]
    wall = (max((r["end"] for r in recs), default=phase["t1"]) - phase["t0"]) or 1e-9
    tokens = sum(r["completion_tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [(r["last"] - r["ttft"]) / (r["completion_tokens"] - 1) for r in ok
            if r["ttft"] is not None and r["completion_tokens"] > 1]
    errors = [r for r in recs if not r["ok"]]
    return {"requests": len(recs), "ok": len(ok), "errors": len(errors),
            "http_503": sum(1 for r in recs if r["status"] == 503),
            "short": sum(1 for r in ok if r["completion_tokens"] < r["max_tokens"]),
            "error_examples": sorted({r["error"] for r in errors})[:3],
            "tokens": tokens, "prompt_tokens": sum(r["prompt_tokens"] for r in ok), "wall_s": wall,
            "tok_s": tokens / wall, "req_s": len(ok) / wall,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99)}


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


# ---------------------------------------------------------------- the server (this process)

def start_server(args: argparse.Namespace, max_prompt: int, max_new: int):
    import torch

    from benchmarks.generation import SHAPES, build_model
    from megatrain.data.tokenizers import build_tokenizer
    from megatrain.inference.engine.engine import EngineConfig, GenerationEngine
    from megatrain.inference.model_calls import register_model_calls
    from megatrain.inference.server import ServerLimits, make_context, make_server

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.shape, device, dtype)
    vocab = int(model.config.vocab_size)
    eod = vocab - 1
    with torch.no_grad():  # the end token's logit is exactly 0: greedy never stops early
        model.embedding.word_embeddings.weight[eod].zero_()
        if model.output_layer is not None:
            model.output_layer.weight[eod].zero_()
    tokenizer = build_tokenizer({"tokenizer_type": "NullTokenizer", "vocab_size": eod})
    assert tokenizer.eod == eod and tokenizer.vocab_size == vocab
    seq = max_prompt + max_new
    seq = min(-(-seq // 256) * 256, int(SHAPES[args.shape]["max_position_embeddings"]))
    engine = GenerationEngine(model, EngineConfig(max_requests=args.max_requests, max_sequence_length=seq,
                                                  max_waiting=max(256, 2 * args.clients),
                                                  compile_decode=args.compile_decode,
                                                  compile_prefill=args.compile_prefill,
                                                  capture_graphs_at_start=not args.lazy_graphs,
                                                  prefill_graphs=False if args.no_prefill_graphs else None))
    register_model_calls(engine)
    limits = ServerLimits(max_prompt_tokens=max_prompt, max_tokens_to_generate=max_new,
                          max_request_bytes=max(1 << 20, 16 * max_prompt))
    ctx = make_context(engine, model, tokenizer, limits)
    if args.frontend_process:
        from megatrain.inference.frontend_process import FrontendProcess

        srv = FrontendProcess(ctx, {"tokenizer_type": "NullTokenizer", "vocab_size": eod}, "127.0.0.1", 0, quiet=True)
    else:
        srv = make_server(ctx, "127.0.0.1", 0, quiet=True)
    srv.start()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    info = {"device_name": name, "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
            "cuda_graphs": bool(engine.runner.cuda_graphs), "seq": seq, "eod": eod,
            "params": sum(p.numel() for p in model.parameters()), "stats": engine.stats}
    return srv, info


def engine_work(before: dict[str, Any], after: dict[str, Any]) -> str:
    """One line: what the engine did between two snapshots of its stats."""
    d = {k: after[k] - before[k] for k in before}
    rows = d["decode_rows"] / d["decode_steps"] if d["decode_steps"] else 0.0
    return (f"{d['decode_steps']} decode steps (mean {rows:.1f} running rows, {d['steps_ahead']} launched ahead), "
            f"{d['prefills']} prompts prefilled in {d['prefill_forwards']} forwards ({d['prefill_tokens']} tokens, "
            f"{d['prefill_s']:.2f} s), {after['graphs']} graphs (decode and prefill)"
            + (f" (recorded at start-up in {after['capture_s']:.1f} s)" if after["capture_s"] else ""))


def _cpu_name() -> str:
    from benchmarks.common import cpu_model

    return cpu_model()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--client-worker":
        client_worker()
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-1.2b",
                   help="a shape of benchmarks/generation.py: tiny, llama-tiny, 1.7b, llama-1.2b")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--max-requests", type=int, default=64, help="engine slots (sequences decoding at once)")
    p.add_argument("--compile-decode", action="store_true", help="the engine's decode forward through torch.compile")
    p.add_argument("--compile-prefill", action="store_true",
                   help="the engine's packed prefill forward through torch.compile (the server's --inference-compile "
                        "sets both)")
    p.add_argument("--single-requests", type=int, default=5, help="requests of the one-client phase")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of the one-client phase")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of concurrent load (default 60 unless --requests-per-client)")
    p.add_argument("--requests-per-client", type=int, default=None)
    p.add_argument("--min-prompt-tokens", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--min-new-tokens", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="max_tokens of the one-client phase and the largest of the concurrent one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--frontend-process", action="store_true",
                   help="HTTP from a child process, the engine in this one (the server's --frontend-process)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--lazy-graphs", action="store_true",
                   help="record each decode graph on first use instead of all at start-up (as the server does)")
    p.add_argument("--no-prefill-graphs", action="store_true",
                   help="eager prefill forwards (default: recorded CUDA graphs per token bucket where the decode has them)")
    p.add_argument("--output", default=None, help="also write the markdown table to this file")
    args = p.parse_args(argv)
    if args.duration is not None and args.requests_per_client is not None:
        p.error("give --duration or --requests-per-client, not both")
    if args.duration is None and args.requests_per_client is None:
        args.duration = 60.0

    import torch  # after the worker's branch: the client process never imports it

    from benchmarks.generation import SHAPES

    if args.shape not in SHAPES:
        p.error(f"--shape must be one of {', '.join(sorted(SHAPES))}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("CUDA is not available; pass --device cpu (with --shape tiny) for a smoke test")
    max_new = args.max_new_tokens
    min_new = min(args.min_new_tokens, max_new)
    positions = int(SHAPES[args.shape]["max_position_embeddings"])
    max_prompt = min(args.max_prompt_tokens, positions - max_new)
    min_prompt = min(args.min_prompt_tokens, max_prompt)
    single_prompt = min(args.prompt_tokens, max_prompt)
    if max_new < 1 or min_prompt < 1:
        p.error(f"--max-new-tokens {max_new} leaves no room for a prompt in {positions} positions")

    t_build = time.perf_counter()
    srv, info = start_server(args, max(max_prompt, single_prompt), max_new)
    print(f"server on port {srv.port}: {args.shape} ({info['params'] / 1e9:.2f} B parameters, {info['dtype']}) on "
          f"{info['device_name']}, built in {time.perf_counter() - t_build:.1f} s", flush=True)
    phase = dict(port=srv.port, eod=info["eod"], seed=args.seed, timeout=args.request_timeout)
    try:
        if not args.no_warmup:
            t = time.perf_counter()
            run_phase(clients=1, prompt_tokens=(single_prompt, single_prompt), max_tokens=(max_new, max_new),
                      requests=1, duration=None, **phase)
            run_phase(clients=args.clients, prompt_tokens=(min_prompt, max_prompt), max_tokens=(min_new, min(max_new, 32)),
                      requests=1, duration=None, **{**phase, "seed": args.seed + 1})
            print(f"warm-up: {time.perf_counter() - t:.1f} s", flush=True)
        snapshot = lambda: dataclasses.asdict(info["stats"])  # noqa: E731
        before = snapshot()
        single = summarize(run_phase(clients=1, prompt_tokens=(single_prompt, single_prompt),
                                     max_tokens=(max_new, max_new), requests=args.single_requests, duration=None,
                                     **phase))
        print(f"one client: {single['tok_s']:.1f} output tokens/s, TTFT p50 {ms(single['ttft_p50'])} ms", flush=True)
        single["engine"], before = engine_work(before, snapshot()), snapshot()
        load = summarize(run_phase(clients=args.clients, prompt_tokens=(min_prompt, max_prompt),
                                   max_tokens=(min_new, max_new), requests=args.requests_per_client,
                                   duration=args.duration, **phase))
        print(f"{args.clients} clients: {load['tok_s']:.1f} output tokens/s over {load['wall_s']:.1f} s", flush=True)
        load["engine"] = engine_work(before, snapshot())
        print(f"engine: {load['engine']}", flush=True)
    finally:
        srv.shutdown()
        srv.server_close()

    how = (f"{args.requests_per_client} requests per client" if args.requests_per_client is not None
           else f"{args.duration:g} s of load")
    config = (f"engine {args.max_requests} slots, max sequence {info['seq']}, "
              f"CUDA graphs {'on' if info['cuda_graphs'] else 'off'}, compile_decode {'on' if args.compile_decode else 'off'}, "
              f"compile_prefill {'on' if args.compile_prefill else 'off'}, "
              f"prefill graphs {'off' if args.no_prefill_graphs or not info['cuda_graphs'] else 'on'}"
              + (", HTTP in its own process" if args.frontend_process else ""))
    lines = [f"### Serving load, {args.shape}, {info['dtype']}, greedy, random weights, streamed /v1/completions", "",
             f"{datetime.date.today()} · {info['device_name']} · torch {info['torch']} · {config}", "",
             f"One client: {args.single_requests} requests of {single_prompt} prompt + {max_new} new tokens, one after "
             f"another. {args.clients} clients: prompts uniform {min_prompt}..{max_prompt} tokens, max_tokens uniform "
             f"{min_new}..{max_new}, seed {args.seed}, {how}.", "",
             "| phase | requests | ok | failed (503) | short | output tokens | wall (s) | output tokens/s | vs one client "
             "| requests/s | TTFT p50 (ms) | TTFT p99 (ms) | per-token p50 (ms) | per-token p99 (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, s in (("1 client", single), (f"{args.clients} clients", load)):
        ratio = s["tok_s"] / single["tok_s"] if single["tok_s"] else float("nan")
        lines.append(f"| {label} | {s['requests']} | {s['ok']} | {s['errors']} ({s['http_503']}) | {s['short']} | "
                     f"{s['tokens']} | {s['wall_s']:.2f} | {s['tok_s']:.1f} | {ratio:.2f}x | {s['req_s']:.2f} | "
                     f"{ms(s['ttft_p50'])} | {ms(s['ttft_p99'])} | {ms(s['tpot_p50'])} | {ms(s['tpot_p99'])} |")
    lines.append("")
    lines.append(f"Engine, one client: {single['engine']}. {args.clients} clients: {load['engine']}.")
    failed = single["errors"] + load["errors"]
    lines.append("")
    lines.append("All requests succeeded." if not failed else
                 f"{failed} requests failed, e.g.: " + "; ".join(single["error_examples"] + load["error_examples"]))
    lines.append(f"\nCommand: `python benchmarks/serving_load.py {' '.join(argv)}`")
    from benchmarks.common import emit_table

    emit_table(lines, args.output)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
