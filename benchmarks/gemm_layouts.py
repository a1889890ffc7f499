"""Which storage of a linear layer's half-precision weight makes cuBLAS fastest on this GPU.

A linear layer's three matmuls per micro-batch (forward ``x W^T``, input gradient ``dY W``, weight
gradient ``dY^T x`` added into the float32 gradient) run with different transposition flags
depending on whether the weight copy is stored ``[out, in]`` (nn.Linear's layout) or transposed
``[in, out]``; cuBLAS picks a different kernel for each. This script times every layer shape of the
benchmark models both ways (and under cuBLAS and cuBLASLt) and prints TFLOP/s per matmul and the
sum per layer, so that the weight copy of the gradient-accumulation fusion can be stored in the
faster layout. CUDA only.

    python benchmarks/gemm_layouts.py [--shapes 1.7b llama-1.2b gpt2-124m] [--reps 20]
"""

from __future__ import annotations

import argparse

import torch

# (tokens per micro-batch, [(name, in_features, out_features), ...]) of the transformer layers
SHAPES: dict[str, tuple[int, list[tuple[str, int, int]]]] = {  # GPT shapes' layers have biases
    "1.7b": (8192, [("qkv", 2048, 6144), ("proj", 2048, 2048), ("fc1", 2048, 8192), ("fc2", 8192, 2048)]),
    "llama-1.2b": (8192, [("qkv", 2048, 3072), ("proj", 2048, 2048), ("gate_up", 2048, 16384),
                          ("down", 8192, 2048)]),
    "gpt2-124m": (16384, [("qkv", 768, 2304), ("proj", 768, 768), ("fc1", 768, 3072), ("fc2", 3072, 768)]),
}


def time_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` timed calls (after warm-up)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def layer_times(tokens: int, fan_in: int, fan_out: int, transposed: bool, bias: bool, reps: int) -> dict[str, float]:
    """Milliseconds of forward, input-gradient and weight-gradient matmuls of one layer."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, fan_in, **bf)
    g = torch.randn(tokens, fan_out, **bf)
    w = torch.randn(fan_out, fan_in, **bf) * 0.02
    stored = w.t().contiguous() if transposed else w  # [in, out] or [out, in]
    w_t = stored if transposed else stored.t()  # the [in, out] operand of the forward, as a view
    w_n = stored.t() if transposed else stored  # the [out, in] operand of the input gradient
    main_grad = torch.zeros(fan_out, fan_in, device="cuda")
    b = torch.zeros(fan_out, **bf)
    return {
        "fwd": time_ms((lambda: torch.addmm(b, x, w_t)) if bias else (lambda: x @ w_t), reps),
        "dgrad": time_ms(lambda: g @ w_n, reps),
        "wgrad": time_ms(lambda: torch.addmm(main_grad, g.t(), x, out_dtype=torch.float32, out=main_grad), reps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_layouts.py needs CUDA")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("TFLOP/s per matmul; 'sum ms' is the layer's three matmuls")
    print(f"{'shape':<11} {'layer':<8} {'library':<9} {'weight':<9} {'fwd':>6} {'dgrad':>6} {'wgrad':>6} {'sum ms':>7}")
    totals: dict[tuple[str, str, str], float] = {}
    for shape in a.shapes:
        tokens, layers = SHAPES[shape]
        for library in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(library)
            for name, fan_in, fan_out in layers:
                flops = 2 * tokens * fan_in * fan_out
                for transposed in (False, True):
                    t = layer_times(tokens, fan_in, fan_out, transposed, not shape.startswith("llama"), a.reps)
                    layout = "[in,out]" if transposed else "[out,in]"
                    key = (shape, library, layout)
                    totals[key] = totals.get(key, 0.0) + sum(t.values())
                    rates = " ".join(f"{flops / (t[k] * 1e9):6.0f}" for k in ("fwd", "dgrad", "wgrad"))
                    print(f"{shape:<11} {name:<8} {library:<9} {layout:<9} {rates} {sum(t.values()):7.3f}")
    torch.backends.cuda.preferred_blas_library("cublas")
    print("\nper layer and micro-batch, all matmuls (ms):")
    for (shape, library, layout), ms in totals.items():
        print(f"  {shape:<11} {library:<9} {layout:<9} {ms:7.3f}")


if __name__ == "__main__":
    main()
