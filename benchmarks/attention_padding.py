"""Times bidirectional attention with a key-padding mask (BERT's) per kernel, forward + backward (CUDA).

For BERT shapes ([b, heads, s, d] bf16, each sample padded after a random length in [s/2, s]):
SDPA's own choice with a bool [b, 1, 1, s] mask, each fused SDPA backend forced with that mask,
flash attention without a mask (no padding: the floor), and FlexAttention (compiled) with a
padding block mask, which skips fully padded key blocks. Checks every masked variant against the
math kernel in float32 on the real rows, then prints a table.

    python benchmarks/attention_padding.py --output attention_padding.md
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

SHAPES = {"bert-large": (32, 16, 512, 64), "bert-base": (32, 12, 512, 64)}


def timed(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lines = ["| shape | kernel | ms fwd+bwd | max rel err (real rows) |", "|---|---|---|---|"]
    flex = torch.compile(flex_attention)
    for name, (b, n, s, d) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        lengths = torch.randint(s // 2, s + 1, (b,), device="cuda", generator=g)
        keep = torch.arange(s, device="cuda")[None] < lengths[:, None]  # [b, s]
        mask = keep[:, None, None, :]
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
        real = keep[:, None, :, None]

        def err(out):
            diff = ((out.float() - ref) * real).norm() / (ref * real).norm()
            return f"{diff.item():.1e}"

        def run(fn):
            def step():
                out = fn()
                out.backward(torch.ones_like(out))
            return step

        rows = [("sdpa default + mask", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))]
        for backend in ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
            def forced(backend=backend):
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            rows.append((f"{backend} + mask", forced))

        def flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)
        rows.append(("FLASH, no mask (floor)", flash))

        def padding(bi, hi, qi, ki):
            return ki < lengths[bi]
        block = create_block_mask(padding, b, None, s, s, device="cuda")
        rows.append(("flex_attention + block mask", lambda: flex(q, k, v, block_mask=block)))
        for label, fn in rows:
            try:
                out = fn()
                e = err(out) if "floor" not in label else "-"
                ms = timed(run(fn))
                lines.append(f"| {name} | {label} | {ms:.3f} | {e} |")
            except Exception as ex:  # noqa: BLE001 - a kernel that refuses is a row saying so
                lines.append(f"| {name} | {label} | refused: {type(ex).__name__}: {str(ex).splitlines()[0][:80]} | |")
    text = "\n".join(lines)
    print(text)
    if a.output:
        open(a.output, "w").write(text + "\n")


if __name__ == "__main__":
    main()
