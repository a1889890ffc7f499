"""T5's bias-gradient op alone (``megatrain::attention_bias_grad``), kernel by kernel: where do its
milliseconds a layer go? Prints a table: for each tile setting the op's time (CUDA events, median of
``--iters``) and the device time of each kernel it launches (``torch.profiler``), beside the op's
floors: its unique bytes at the DRAM rate and its two score matmuls at the bf16 matmul rate measured in
the same run.

    python benchmarks/bias_gradient_kernel.py                 # T5-base encoder layer (b 64, 12 x 64, s 512), CUDA
    python benchmarks/bias_gradient_kernel.py --shape tiny    # a smoke run (CUDA, or TRITON_INTERPRET=1 on CPU)

Settings are ``BMxBN-wW[-sS][-pP][-lBMxBNwW][-lpP]``: the gradient kernel's tile and warps (``TILE``), S
programs per tile sharing its batch (``SPLIT_BATCH``), P software-pipelining stages (``STAGES``); after
``-l`` the log-sum-exp kernel's tile and warps (``LSE_TILE``) and after ``-lp`` its stages (``LSE_STAGES``).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain.models.common import bias_gradient_kernel as bgk  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import measure_matmul_peak  # noqa: E402

SHAPES = {"t5-base": (64, 12, 512, 64), "tiny": (2, 2, 32, 16)}  # batch, heads, seq, head dim
# the gradient kernel's fastest tiles of 2026-12-07, then log-sum-exp kernel tiles (FlashAttention's forward
# on Hopper favours 128-row tiles with 8 warps)
DEFAULT_SETTINGS = ["64x64-w8", "64x128-w8", "64x64-w8-l64x64w8", "64x64-w8-l128x64w8", "64x64-w8-l128x128w8",
                    "64x64-w8-l128x64w4", "64x64-w8-l64x128w4", "64x64-w8-l128x64w8-lp2", "64x64-w8-l128x64w8-lp4",
                    "64x64-w8-l64x64w4-lp4"]
SETTING = re.compile(r"(\d+)x(\d+)-w(\d+)(?:-s(\d+))?(?:-p(\d+))?(?:-l(\d+)x(\d+)w(\d+))?(?:-lp(\d+))?")


def parse_setting(text: str) -> tuple[tuple[int, int, int], int, int | None, tuple[int, int, int], int | None]:
    """(TILE, SPLIT_BATCH, STAGES, LSE_TILE, LSE_STAGES) of a setting's text."""
    m = SETTING.fullmatch(text)
    if not m:
        raise SystemExit(f"--settings: {text!r} is not BMxBN-wW[-sS][-pP][-lBMxBNwW][-lpP]")
    bm, bn, w, s, p, lbm, lbn, lw, lp = m.groups()
    lse_tile = (int(lbm), int(lbn), int(lw)) if lbm else (bgk.LSE_TILE or bgk.lse_tile_from_env())
    return (int(bm), int(bn), int(w)), int(s or 1), (int(p) if p else None), lse_tile, (int(lp) if lp else None)


def inputs(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    b, h, s, d = SHAPES[shape]
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, generator=g).to(device, dtype)

    q, k, v, dout = rand(b, h, s, d), rand(b, h, s, d), rand(b, h, s, d), rand(b, h, s, d)
    # T5's bias: a [1, heads, s, s] permuted view (key stride = heads), as the bucket lookup makes it
    bias = rand(1, s, s, h).permute(0, 3, 1, 2)
    lengths = (s * 0.9 + 10 * torch.randn(b, generator=g)).round().clamp(8, s).long()
    keep = (torch.arange(s)[None, :] < lengths[:, None]).view(b, 1, 1, s).to(device)
    mask = bias.masked_fill(~keep, float("-inf")).to(dtype)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    return q, k, v, out, dout, bias, keep


def time_op(args, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        bgk.attention_bias_grad(*args, 1.0)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_times(args, iters: int) -> dict[str, float]:
    """Device ms per op call of each kernel the op launches, by short name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            bgk.attention_bias_grad(*args, 1.0)
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us and e.key not in ("attention_bias_grad", "megatrain::attention_bias_grad"):
            name = "lse" if "lse_kernel" in e.key else "grad" if "grad_kernel" in e.key else "other"
            times[name] = times.get(name, 0.0) + us / 1e3 / iters
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="t5-base", choices=list(SHAPES))
    ap.add_argument("--settings", nargs="+", default=None,
                    help="BMxBN-wW[-sS][-pP][-lBMxBNwW][-lpP] (default: ten of them)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--output", default=None, help="also write the table here")
    a = ap.parse_args(argv)
    settings = a.settings or (DEFAULT_SETTINGS if a.shape == "t5-base"
                              else ["16x16-w4", "16x16-w4-s2", "16x16-w4-l32x16w4-lp2"])
    parsed = [(s, *parse_setting(s)) for s in settings]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not bgk.kernel_available(device):
        raise SystemExit("the kernel needs Triton on CUDA (or TRITON_INTERPRET=1 on the CPU)")
    args = inputs(a.shape, device, torch.bfloat16 if cuda else torch.float32)
    b, h, s, d = SHAPES[a.shape]
    lines = [f"# attention_bias_grad kernel by kernel: {a.shape} (b {b}, heads {h}, s {s}, d {d}), "
             f"{torch.cuda.get_device_name() if cuda else 'CPU (Triton interpreter)'}, torch {torch.__version__}", ""]
    if cuda:
        rate = measure_matmul_peak() * 1e12  # FLOP/s
        unique = sum(t.numel() * t.element_size() for t in args[:5]) + h * s * s * (2 + 4)  # + bias read, grad write
        flops = 2 * (2 * b * h * s * s * d)  # q k^T twice (lse and gradient kernels) + dO v^T
        lines.append(f"floors: {unique / 1e6:.0f} MB unique at 3.35 TB/s = {unique / 3.35e12 * 1e3:.3f} ms; "
                     f"{flops / 1e9:.0f} GFLOP at the measured {rate / 1e12:.1f} TFLOP/s = {flops / rate * 1e3:.3f} ms")
        lines.append("")
    lines += ["| setting | op ms | lse kernel ms | gradient kernel ms | other ms |", "|---|---|---|---|---|"]
    saved = (bgk.TILE, bgk.SPLIT_BATCH, bgk.STAGES, bgk.LSE_TILE, bgk.LSE_STAGES)
    reference = None
    try:
        for name, tile, split, stages, lse_tile, lse_stages in parsed:
            bgk.TILE, bgk.SPLIT_BATCH, bgk.STAGES = tile, split, stages
            bgk.LSE_TILE, bgk.LSE_STAGES = lse_tile, lse_stages
            try:
                grad = bgk.attention_bias_grad(*args, 1.0)
            except Exception as e:  # a tile the device's Triton cannot build (shared memory, registers)
                why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
                lines.append(f"| {name} | error: {why} | | | |")
                print(lines[-1], flush=True)
                continue
            if reference is None:
                reference = grad
            elif not torch.allclose(grad, reference, rtol=1e-3, atol=1e-3):
                lines.append(f"| {name} | differs from {parsed[0][0]} by {float((grad - reference).abs().max()):.3g} "
                             f"| | | |")
                continue
            if not cuda:
                lines.append(f"| {name} | ran (interpreter) | | | |")
                continue
            op = time_op(args, a.iters)
            k = kernel_times(args, max(3, a.iters // 4))
            lines.append(f"| {name} | {op:.3f} | {k.get('lse', 0):.3f} | {k.get('grad', 0):.3f} | "
                         f"{k.get('other', 0):.3f} |")
            print(lines[-1], flush=True)
    finally:
        bgk.TILE, bgk.SPLIT_BATCH, bgk.STAGES, bgk.LSE_TILE, bgk.LSE_STAGES = saved
    text = "\n".join(lines) + "\n"
    print(text)
    if a.output:
        Path(a.output).write_text(text)


if __name__ == "__main__":
    main()
