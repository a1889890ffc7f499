"""The optimizer's passes alone at a model's parameter shapes: torch's fused AdamW with the clipping
divisor as ``grad_scale`` plus the gradient-accumulation fusion's bf16 refresh (``foreach_copy_``), the
trainer's default today, against megatrain's Triton AdamW kernel writing the bf16 copies itself
(``MEGATRAIN_ADAMW_KERNEL=1``). Prints a table: ms per step and the bytes each moves per step.

    python benchmarks/adamw_kernel.py                     # LLaMA-1.2B's parameter shapes, CUDA
    python benchmarks/adamw_kernel.py --shape tiny --steps 2   # a smoke run (CUDA, or TRITON_INTERPRET=1 on CPU)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain.optimizer import OptimizerConfig, build_optimizer  # noqa: E402
from megatrain.runtime import adamw_kernel  # noqa: E402
from megatrain.runtime.adamw_kernel import KernelAdamW  # noqa: E402


def shapes(name: str) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, has a bf16 copy) of every trained parameter: LLaMA-1.2B (16 layers, hidden 2048, GQA 32/8,
    SwiGLU 8192, untied 128256 vocabulary) or a tiny stand-in."""
    if name == "tiny":
        return [((64, 32), True), ((32,), False), ((100, 32), True)]
    h, ffn, vocab, layers, kv = 2048, 8192, 128256, 16, 512
    per_layer = [((h + 2 * kv, h), True), ((h, h), True), ((2 * ffn, h), True), ((h, ffn), True), ((h,), False),
                 ((h,), False)]
    return [((vocab, h), False)] + per_layer * layers + [((h,), False), ((vocab, h), True)]


def timed(fn, steps: int, device: torch.device) -> float:
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:] if len(times) > 1 else times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-1.2b", choices=["llama-1.2b", "tiny"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--blocks", nargs="+", default=["2048x8", "4096x8", "1024x4", "8192x16"],
                    help="the kernel's elements a program x warps (runtime.adamw_kernel.BLOCK, WARPS), a row each")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    settings = [(False, None)] + [(True, tuple(int(x) for x in b.split("x"))) for b in a.blocks]
    for kernel, block in settings:
        if block is not None:
            adamw_kernel.BLOCK, adamw_kernel.WARPS = block
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s, _ in shapes(a.shape)]
        halves = [torch.empty_like(p, dtype=torch.bfloat16) if copy else None
                  for p, (_, copy) in zip(params, shapes(a.shape))]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        model = torch.nn.ParameterList(params)
        opt = build_optimizer(model, OptimizerConfig(lr=1e-4, weight_decay=0.1, adamw_kernel=kernel,
                                                     fused=None if kernel else True))
        fused_pairs = [(p, h) for p, h in zip(params, halves) if h is not None]
        if isinstance(opt, KernelAdamW):
            opt.set_half_copies(fused_pairs)

        def step() -> None:
            opt.grad_scale = torch.tensor(1.3, device=device)
            opt.found_inf = torch.tensor(0.0, device=device)
            opt.step()
            if not isinstance(opt, KernelAdamW):  # the separate refresh of the bf16 copies
                torch._foreach_copy_([h for _, h in fused_pairs], [p for p, _ in fused_pairs])

        ms = timed(step, a.steps, device)
        n = sum(p.numel() for p in params)
        n_half = sum(p.numel() for p, _ in fused_pairs)
        moved = n * 28 + (n_half * 2 if kernel else n * 4 + n_half * 6)
        rows.append((type(opt).__name__ + (" + foreach_copy_ refresh" if not kernel
                                           else f" (copies in the step; {block[0]} x {block[1]} warps)"),
                     ms, moved / 1e9, moved / ms / 1e6))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"AdamW step over {a.shape}'s {sum(p.numel() for p in params) / 1e9:.3f}e9 parameters, {name}, "
          f"torch {torch.__version__}, medians of {a.steps - 1}")
    print("\n| optimizer | ms/step | GB moved | GB/s |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.2f} | {r[2]:.1f} | {r[3]:.0f} |")


if __name__ == "__main__":
    main()
