"""Times causal SDPA forward and forward+backward per fused backend for the benchmark shapes (CUDA).

For each shape of ``throughput.py`` (batch, heads, groups, sequence, head dim) and each backend
(flash, cuDNN, memory-efficient, and SDPA's own choice), in two input layouts: ``model`` (q, k, v
as the model hands them over: strided views of one fused QKV projection, [b, s, ...] transposed)
and ``contiguous`` ([b, heads, s, d] contiguous). Prints a table with milliseconds and TFLOP/s
(causal: half the s x s work counted) and, with ``--output``, writes it as markdown.

    python benchmarks/attention_kernels.py --output attention.md
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

SHAPES = {  # name: (batch, heads, groups, seq, head_dim)
    "gpt2-124m": (16, 12, 12, 1024, 64),
    "1.7b": (2, 16, 16, 4096, 128),
    "llama-1.2b": (2, 32, 8, 4096, 64),
}
BACKENDS = ("default", "CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def make_inputs(b: int, n: int, g: int, s: int, d: int, layout: str) -> tuple[torch.Tensor, ...]:
    """q [b, n, s, d], k and v [b, g, s, d] in bf16 with requires_grad on the leaf."""
    hpg = n // g
    if layout == "model":
        qkv = torch.randn(b, s, g, hpg + 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        q = qkv[:, :, :, :hpg].reshape(b, s, n, d).transpose(1, 2)
        k = qkv[:, :, :, hpg].transpose(1, 2)
        v = qkv[:, :, :, hpg + 1].transpose(1, 2)
        return (qkv,), (q, k, v)
    q = torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, g, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, g, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return (q, k, v), (q, k, v)


def time_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measure(shape: tuple[int, ...], backend: str, layout: str) -> tuple[float, float] | str:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, n, g, s, d = shape
    leaves, (q, k, v) = make_inputs(b, n, g, s, d, layout)
    gqa = {"enable_gqa": True} if n != g else {}

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)

    def fwd_bwd():
        out = fwd()
        torch.autograd.grad(out, leaves, torch.ones_like(out))

    ctx = sdpa_kernel([getattr(SDPBackend, backend)]) if backend != "default" else torch.enable_grad()
    try:
        with ctx:
            return time_ms(fwd), time_ms(fwd_bwd)
    except RuntimeError as e:
        return str(e).splitlines()[0][:80]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--output", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_kernels.py needs CUDA", file=sys.stderr)
        return 2
    rows = ["| shape | layout | backend | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |",
            "|---|---|---|---|---|---|---|"]
    for name in a.shapes:
        b, n, g, s, d = SHAPES[name]
        fwd_flops = 4 * b * n * s * s * d / 2  # two matmuls, causal half
        for layout in ("model", "contiguous"):
            for backend in BACKENDS:
                r = measure(SHAPES[name], backend, layout)
                if isinstance(r, str):
                    rows.append(f"| {name} | {layout} | {backend} | - | - | - | {r} |")
                    continue
                f, fb = r
                rows.append(f"| {name} | {layout} | {backend} | {f:.3f} | {fwd_flops / f / 1e9:.0f} | "
                            f"{fb:.3f} | {3.5 * fwd_flops / fb / 1e9:.0f} |")
                print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    print(text)
    if a.output:
        with open(a.output, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
