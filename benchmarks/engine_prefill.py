"""The engine's prefill forward alone: packs of prompts into one forward, two attention modes.

    python benchmarks/engine_prefill.py                                   # llama-1.2b, bf16, CUDA
    python benchmarks/engine_prefill.py --shape llama-tiny --device cpu --packs 1x16 4x8   # smoke test
    python benchmarks/engine_prefill.py --profile                          # + top kernels of the largest pack

A random-weight model of ``--shape`` (`benchmarks/generation.py`'s shapes) and the engine's
`ModelRunner` over a slot cache: each ``--packs`` entry ``NxL`` prefills N prompts of L tokens packed
into one forward (``ModelRunner.prefill``, what a step of the engine runs when requests join), with
the cache's ``packed_attention`` set to ``segments`` (attention per prompt through the fused causal
SDPA), to ``mask`` (one SDPA over the pack with a block-diagonal bool mask) and ``mask-compiled``
(that forward through torch.compile with a dynamic token count: ``EngineConfig.compile_prefill``)
and ``graphs`` (the pack padded to the next token bucket and replayed as a recorded CUDA graph:
``EngineConfig.prefill_graphs``, the default with CUDA graphs; the first run of a bucket records it).
``--busy-thread``: a second Python thread does pure-Python work the whole time (as a server's event
loop does under load), so the table shows what sharing the interpreter lock costs each mode. Reported: the median
time of the forward (device-synchronised), prompt tokens/s, and TFLOP/s by 2 x parameters x tokens plus
the causal attention's 2 x 2 x L^2/2 x hidden per layer and prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import emit_table  # noqa: E402
from benchmarks.generation import DTYPES, SHAPES, build_model, sync  # noqa: E402
from megatrain.inference.engine.runner import ModelRunner  # noqa: E402
from megatrain.inference.engine.slot_cache import CacheShape, SlotKVCache  # noqa: E402
from megatrain.models.common.attention import SelfAttention  # noqa: E402

MODES = ("segments", "mask", "mask-compiled", "graphs")


def busy_loop(stop: threading.Event) -> None:
    """Pure-Python work until ``stop``: small JSON round trips, as a server's event loop does per token."""
    while not stop.is_set():
        json.loads(json.dumps({"id": 1, "choices": [{"text": "x" * 16, "index": 0}]}))


def parse_pack(text: str) -> tuple[int, int]:
    try:
        n, length = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--packs: {text!r} is not NxL (e.g. 4x512)") from None
    if n <= 0 or length <= 0:
        raise argparse.ArgumentTypeError(f"--packs: {text!r} needs positive N and L")
    return n, length


def pack_flops(model, n: int, length: int) -> float:
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    return 2.0 * params * n * length + n * c.num_layers * 2 * 2 * (length * length / 2) * c.hidden_size


def time_prefill(runner: ModelRunner, items: list[tuple[int, list[int]]], repeats: int, device) -> float:
    runner.prefill(items)  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        runner.prefill(items)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1.2b")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--packs", type=parse_pack, nargs="+",
                   default=[parse_pack(x) for x in ("1x512", "1x2048", "4x128", "4x512", "8x256", "16x128")])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--busy-thread", action="store_true", help="a pure-Python thread runs beside the prefills")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--profile", action="store_true", help="print the top kernels of the largest pack, both modes")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; pass --device cpu (with --shape llama-tiny) for a smoke test")
    model = build_model(args.shape, device, DTYPES[args.dtype])
    layers = tuple(m.layer_number for m in model.modules() if isinstance(m, SelfAttention))
    slots = max(n for n, _ in args.packs)
    longest = max(length for _, length in args.packs)
    shape = CacheShape(layers, model.config.num_query_groups, model.config.kv_channels, slots, longest + 1)
    if "graphs" in args.modes and device.type != "cuda":
        p.error("--modes graphs records CUDA graphs: it needs --device cuda")
    runners = {mode: ModelRunner(model, SlotKVCache(shape, DTYPES[args.dtype], device,
                                                    packed_attention="mask" if mode == "graphs" else mode.split("-")[0]),
                                 device, cuda_graphs=mode == "graphs", compile_prefill=mode.endswith("compiled"),
                                 prefill_graphs=mode == "graphs", prefill_tokens=max(n * length for n, length in args.packs))
               for mode in args.modes}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"### Engine prefill, {args.shape}, {args.dtype}, random weights", "",
             f"{name} · torch {torch.__version__} · median of {args.repeats}"
             + (" · a busy pure-Python thread beside it" if args.busy_thread else ""), "",
             "| pack | tokens | mode | ms | prompt tokens/s | TFLOP/s |", "|---|---:|---|---:|---:|---:|"]
    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    stop = threading.Event()
    if args.busy_thread:
        threading.Thread(target=busy_loop, args=(stop,), daemon=True).start()
    with torch.inference_mode():
        for n, length in args.packs:
            items = [(slot, torch.randint(0, vocab, (length,), generator=g).tolist()) for slot in range(n)]
            for mode, runner in runners.items():
                if n == 1 and mode == "mask" and "segments" in runners:
                    continue  # one prompt: the same causal SDPA in both modes
                seconds = time_prefill(runner, items, args.repeats, device)
                lines.append(f"| {n}x{length} | {n * length} | {mode} | {seconds * 1e3:.2f} | "
                             f"{n * length / seconds:,.0f} | {pack_flops(model, n, length) / seconds / 1e12:.1f} |")
                print(lines[-1], flush=True)
        if args.profile:
            n, length = max(args.packs, key=lambda nl: (nl[0] > 1, nl[0] * nl[1]))
            items = [(slot, torch.randint(0, vocab, (length,), generator=g).tolist()) for slot in range(n)]
            for mode, runner in runners.items():
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    runner.prefill(items)
                    sync(device)
                key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
                lines += ["", f"Top kernels, pack {n}x{length}, {mode}:", "```",
                          prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60), "```"]
    stop.set()
    lines.append(f"\nCommand: `python benchmarks/engine_prefill.py {' '.join(argv)}`")
    emit_table(lines, args.output)


if __name__ == "__main__":
    main()
