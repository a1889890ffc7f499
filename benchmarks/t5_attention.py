"""T5's encoder attention alone, forward + backward, in the ways megatrain can run it: where do the
relative position bias's milliseconds go? Prints a table.

    python benchmarks/t5_attention.py                          # T5-base encoder (12 layers, b 64, 12 x 64, s 512), CUDA
    python benchmarks/t5_attention.py --shape tiny --device cpu --variants sdpa-bias sdpa-pad   # a smoke run

Every variant runs the encoder's 12 self-attentions of one step (fresh bf16 q, k, v per layer, the
one [buckets, heads] bias table shared by all layers, the same padding), compiled as a whole with
``torch.compile``, then their backward from fixed output gradients; the time is the median of
``--iters`` forward + backward passes (CUDA events). Variants (the first is what ``pretrain_t5.py``
runs in the Hugging Face layout today):

* ``sdpa-bias``: the bias and the padding as one [b, heads, s, s] float mask built once per forward
  (``megatrain.models.t5.model.self_attention_mask``), every layer's SDPA reading it and writing its
  gradient ([b, heads, s, s] per layer, summed across layers and then over the batch);
* ``sdpa-bias-frozen``: the same mask with the table not trained (no mask gradient): what the
  gradient costs;
* ``sdpa-bias-frozen-cudnn``, ``sdpa-pad-cudnn``: those two with SDPA held to cuDNN's attention
  (``sdpa_kernel(CUDNN_ATTENTION)``; its backward gives no mask gradient, so only frozen masks): is
  cuDNN's flash-style kernel with a [b, heads, s, s] bias faster than the efficient kernel's?
* ``sdpa-bias-tap`` (``-cudnn``): SDPA on the detached mask, the bias gradient recomputed apart
  (``megatrain.models.common.bias_gradient``: with Triton on CUDA the kernel of ``bias_gradient_kernel``,
  tiles of the gradient summed over the batch in registers; else PyTorch under inductor);
  ``sdpa-bias-tap-BMxBN-wW`` the kernel with other tiles and warps (``bias_gradient_kernel.TILE``),
  ``-sS`` with each tile's batch shared among S programs (``bias_gradient_kernel.SPLIT_BATCH``);
  on CUDA the forward runs SDPA's memory-efficient kernel directly and hands its log-sum-exp to the
  kernel (``bias_gradient.AttentionWithLogSumExp``); ``sdpa-bias-tap-lse-kernel`` runs SDPA and
  lets the kernel compute the log-sum-exp itself (as ``-cudnn`` does; the model's default since the
  H100 measured it faster, 2.23 against 3.22 ms a layer);
* ``sdpa-bias-per-layer``: the mask built inside each layer, so each layer's mask gradient is summed
  over the batch at once instead of accumulated across layers at [b, heads, s, s];
* ``sdpa-bias-shared``: the mask built once, handed to each layer through an autograd function whose
  backward sums that layer's mask gradient over the batch at once;
* ``sdpa-pad``: the padding alone ([b, 1, 1, s] bool), no bias: the floor the learned-position
  layout runs at;
* ``flex``: FlexAttention as ``--attention-backend flex`` runs it (the bias as a score_mod over the
  [b, heads, distances] table, the padding as a block mask, ``flex_attention.CUDA_KERNEL_OPTIONS``);
  ``flex-frozen`` with the table not trained; ``flex-pad`` the block mask alone; ``flex-fwd-*``
  the trained bias with other kernel tiles; ``flex-autotune`` with inductor's max-autotune choosing them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {"t5-base": (12, 64, 12, 512, 64), "tiny": (2, 4, 4, 64, 16)}  # layers, batch, heads, seq, head dim

# Kernel options (``fwd_``/``bwd_`` prefixes reach one kernel only); a variant's options replace
# flex_attention.CUDA_KERNEL_OPTIONS for its run.
TILES = {
    # the forward at inductor's Hopper default for bf16 d 64 (128 x 128, three stages), backward tiles that fit
    "flex-fwd-default-bwd-32x64": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                                   "bwd_num_stages": 2},
    "flex-fwd-default-bwd-64x64": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                                   "bwd_num_stages": 2},
    "flex-fwd-default-bwd-64x128": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128,
                                    "bwd_BLOCK_N2": 64, "bwd_num_stages": 2, "bwd_num_warps": 8},
    "flex-fwd-128x64-bwd-32x64": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 3,
                                  "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                                  "bwd_num_stages": 2},
}
AUTOTUNED = "flex-autotune"  # no options: inductor's max-autotune picks among its flex configs
# the bias-gradient kernel's ((BLOCK_M, BLOCK_N, num_warps), SPLIT_BATCH) for the sdpa-bias-tap-* variants
# (sdpa-bias-tap itself: the module's defaults)
TAP_TILES = {"sdpa-bias-tap-128x64-w8": ((128, 64, 8), 1), "sdpa-bias-tap-64x128-w8": ((64, 128, 8), 1),
             "sdpa-bias-tap-32x64-w4": ((32, 64, 4), 1), "sdpa-bias-tap-64x64-w4": ((64, 64, 4), 1),
             "sdpa-bias-tap-64x64-w8-s2": ((64, 64, 8), 2), "sdpa-bias-tap-64x64-w8-s4": ((64, 64, 8), 4),
             "sdpa-bias-tap-128x128-w8-s4": ((128, 128, 8), 4)}
VARIANTS = ["sdpa-bias", "sdpa-bias-frozen", "sdpa-bias-frozen-cudnn", "sdpa-bias-tap", "sdpa-bias-tap-lse-kernel",
            "sdpa-bias-tap-cudnn",
            *TAP_TILES,
            "sdpa-bias-per-layer", "sdpa-bias-shared", "sdpa-pad", "sdpa-pad-cudnn", "flex", "flex-frozen", "flex-pad",
            *TILES, AUTOTUNED]


def lengths(batch: int, seq: int, seed: int):
    """Encoder lengths like span-corrupted T5 samples: most near 0.9 s, one in ten short."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = (seq * 0.9 + 10 * torch.randn(batch, generator=g)).round().clamp(8, seq).long()
    short = torch.rand(batch, generator=g) < 0.1
    n[short] = torch.randint(8, seq + 1, (int(short.sum()),), generator=g)
    return n


@functools.cache
def _shared_mask_class():
    import torch

    class SharedMask(torch.autograd.Function):
        """The mask built once per forward (``mask``, no graph of its own) handed to a layer as if built
        from ``bias`` [1, heads, s, s]: the layer's mask gradient is summed over the batch where keys are
        kept at once (one [1, heads, s, s] gradient per layer, not [b, heads, s, s] ones accumulated)."""

        @staticmethod
        def forward(ctx, bias, mask, keep):
            ctx.save_for_backward(keep)
            ctx.bias_dtype = bias.dtype
            return mask.view_as(mask)

        @staticmethod
        def backward(ctx, grad):
            (keep,) = ctx.saved_tensors
            return grad.masked_fill(~keep, 0).sum(0, keepdim=True, dtype=torch.float32).to(ctx.bias_dtype), None, None
    return SharedMask


def build(variant: str, layers: int, bias_table, keep, seq: int, dtype) -> Callable:
    """The compiled encoder-attention function of one variant: (qs, ks, vs) -> outputs."""
    import torch
    import torch.nn.functional as F

    from megatrain.models.common import flex_attention as fa
    from megatrain.models.common.bias_gradient import attention_with_bias, biased_mask
    from megatrain.models.t5.model import padding_key_mask, self_attention_mask

    if variant.startswith("sdpa"):
        shared_mask = _shared_mask_class()

        def fn(qs, ks, vs):
            shared = None
            if variant.startswith("sdpa-pad"):
                mask = padding_key_mask(keep)
            elif variant == "sdpa-bias-per-layer":
                mask = None
            elif variant.startswith("sdpa-bias-tap"):
                bias = bias_table(seq, seq, keep.device)
                kept = padding_key_mask(keep)
                mask = biased_mask(bias.detach(), kept, dtype)
                return [attention_with_bias(q, k, v, mask, bias, kept) for q, k, v in zip(qs, ks, vs)]
            elif variant == "sdpa-bias-shared":
                bias = bias_table(seq, seq, keep.device)
                mask = self_attention_mask(keep, seq, causal=False, bias=bias.detach(), dtype=dtype)
                shared = (bias, padding_key_mask(keep))
            else:
                bias = bias_table(seq, seq, keep.device)
                if variant.startswith("sdpa-bias-frozen"):
                    bias = bias.detach()
                mask = self_attention_mask(keep, seq, causal=False, bias=bias, dtype=dtype)
            outs = []
            for q, k, v in zip(qs, ks, vs):
                m = mask if mask is not None else self_attention_mask(
                    keep, seq, causal=False, bias=bias_table(seq, seq, keep.device), dtype=dtype)
                if shared is not None:
                    m = shared_mask.apply(shared[0], mask, shared[1])
                outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=m))
            return outs
        return torch.compile(fn)

    fa.CUDA_KERNEL_OPTIONS = {} if variant == AUTOTUNED else dict(TILES.get(variant, _DEFAULT_TILES))

    def flex_fn(qs, ks, vs):
        bias = None
        if variant != "flex-pad":
            table, offset = bias_table.distance_bias(seq, seq, keep.device, pad_to=fa.BLOCK_SIZE)
            if variant == "flex-frozen":
                table = table.detach()
            bias = (table.unsqueeze(0).expand(keep.shape[0], -1, -1).contiguous(), offset)
        mask = fa.flex_mask(keep != 0, seq, seq, causal=False, device=keep.device, position_bias=bias)
        return [fa.flex_attention_forward(q, k, v, mask) for q, k, v in zip(qs, ks, vs)]
    return torch.compile(flex_fn, mode="max-autotune-no-cudagraphs" if variant == AUTOTUNED else None)


_DEFAULT_TILES: dict = {}


def run_variant(variant: str, args) -> dict:
    import torch

    from megatrain.models.common.relative_position import RelativePositionBias

    layers, b, h, s, d = SHAPES[args.shape]
    dev = torch.device(args.device)
    torch.manual_seed(0)
    table = RelativePositionBias(h, num_buckets=32, max_distance=128, bidirectional=True).to(dev)
    n = lengths(b, s, seed=1).to(dev)
    keep = (torch.arange(s, device=dev)[None, :] < n[:, None]).long()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    def leaf():
        return torch.randn(b, s, h, d, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()

    qs, ks, vs = ([leaf() for _ in range(layers)] for _ in range(3))
    grads = [torch.randn(b, h, s, d, device=dev, dtype=dtype) for _ in range(layers)]
    torch._dynamo.reset()
    from megatrain.models.common import bias_gradient_kernel as bgk
    if not hasattr(bgk, "_DEFAULTS"):
        bgk._DEFAULTS = (bgk.TILE, bgk.SPLIT_BATCH)
    bgk.TILE, bgk.SPLIT_BATCH = TAP_TILES.get(variant, bgk._DEFAULTS)
    from megatrain.models.common import bias_gradient as bg
    # the log-sum-exp from SDPA's memory-efficient kernel, unless the variant asks for the kernel's own
    # (or cuDNN's attention, which the direct call would bypass)
    bg.SDPA_LOG_SUM_EXP = not (variant.endswith("-lse-kernel") or variant.endswith("-cudnn"))
    with contextlib.ExitStack() as stack:
        if variant.endswith("-cudnn"):
            from torch.nn.attention import SDPBackend, sdpa_kernel
            stack.enter_context(sdpa_kernel([SDPBackend.CUDNN_ATTENTION]))
        return _timed(variant, args, build(variant, layers, table, keep, s, dtype), qs, ks, vs, grads, table, dev)


def _timed(variant: str, args, fn, qs, ks, vs, grads, table, dev) -> dict:
    import torch

    layers = len(qs)
    times = []
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.iters):
        for t in (*qs, *ks, *vs, *table.parameters()):
            t.grad = None
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            import time
            t0 = time.perf_counter()
        outs = fn(qs, ks, vs)
        torch.autograd.backward(outs, grads)
        if dev.type == "cuda":
            end.record()
            sync()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        if i >= args.warmup:
            times.append(ms)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    return {"variant": variant, "ms": statistics.median(times), "per_layer_ms": statistics.median(times) / layers,
            "peak_gib": peak, "bias_grad": None if table.relative_attention_bias.weight.grad is None
            else float(table.relative_attention_bias.weight.grad.float().norm())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="t5-base")
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--output", default=None, help="also write the table here")
    p.add_argument("--best-options", default=None,
                   help="write the fastest trained-bias flex variant's kernel options here (JSON, for "
                        "MEGATRAIN_FLEX_KERNEL_OPTIONS)")
    args = p.parse_args(argv)

    import torch

    from megatrain.models.common import flex_attention as fa
    from megatrain.models.common.bias_gradient import attention_with_bias, biased_mask

    global _DEFAULT_TILES
    _DEFAULT_TILES = dict(fa.CUDA_KERNEL_OPTIONS)
    layers, b, h, s, d = SHAPES[args.shape]
    best: tuple[float, str] | None = None
    lines = [f"T5 encoder attention, {layers} layers, b {b}, {h} heads x {d}, s {s}, torch {torch.__version__}, "
             f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}", "",
             "| variant | ms fwd+bwd (all layers) | ms per layer | peak GiB | bias grad norm |", "|---|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for variant in args.variants:
        try:
            r = run_variant(variant, args)
            if variant in ("flex", AUTOTUNED, *TILES) and (best is None or r["ms"] < best[0]):
                best = (r["ms"], variant)
            row = (f"| {variant} | {r['ms']:.2f} | {r['per_layer_ms']:.3f} | {r['peak_gib']:.1f} | "
                   f"{'-' if r['bias_grad'] is None else format(r['bias_grad'], '.4g')} |")
        except Exception as e:  # one variant's failure is one row
            msg = str(e).strip().splitlines()
            row = f"| {variant} | failed: {type(e).__name__}: {(msg[0] if msg else '')[:160]} | | | |"
        print(row, flush=True)
        lines.append(row)
        if args.output:  # after every row: a call cut short keeps the rows done
            Path(args.output).write_text("\n".join(lines) + "\n", encoding="utf-8")
    if best is not None and args.best_options:
        # the fastest FlexAttention variant with the trained bias, as MEGATRAIN_FLEX_KERNEL_OPTIONS takes it
        options = {} if best[1] == AUTOTUNED else TILES.get(best[1], _DEFAULT_TILES)
        Path(args.best_options).write_text(json.dumps(options), encoding="utf-8")
        print(f"fastest flex variant with the trained bias: {best[1]} ({best[0]:.2f} ms): {json.dumps(options)}")


if __name__ == "__main__":
    main()
