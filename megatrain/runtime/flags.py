"""Flags of the runtime machinery (:mod:`megatrain.runtime`), with Megatron-LM's names where it has them.

``mixed precision``: fp8 matmuls (:mod:`megatrain.runtime.fp8`); ``training``: the chunked output-layer
loss (:mod:`megatrain.runtime.fused_loss`), gradient-accumulation fusion
(:mod:`megatrain.runtime.grad_accumulation_fusion`) and CUDA graphs of the micro-batch
(:mod:`megatrain.runtime.cuda_graph`).
"""

from __future__ import annotations

import argparse

from megatrain.flags import flag_section

__all__ = ["add_runtime_flags"]


def add_runtime_flags(parser: argparse.ArgumentParser) -> None:
    """Add the fp8, fused-loss, gradient-accumulation-fusion and CUDA-graph flags to ``parser``."""
    g = flag_section(parser, "mixed precision")
    g.add_argument("--fp8-format", default=None, choices=["e4m3", "hybrid"],
                   help="fp8 matmuls in the transformer layers (needs --bf16; megatrain's fp8 layers where the "
                        "gradient-accumulation fusion applies, torchao's under TP, PP, FSDP2 or with "
                        "MEGATRAIN_FP8_BACKEND=torchao): hybrid = e4m3 forward, e5m2 gradients; e4m3 = e4m3 "
                        "everywhere")
    g.add_argument("--fp8-recipe", default=None, choices=["tensorwise", "delayed", "mxfp8", "blockwise"],
                   help="fp8 scaling: tensorwise (each input and output gradient scaled from its own current "
                        "absolute maximum) or delayed (Megatron's default: scaled from an amax history of earlier "
                        "micro-batches, the current maximum recorded in the same pass as the cast; megatrain's fp8 "
                        "layers only: torchao's, under TP, PP or FSDP2, scale tensorwise, with a note). Unset: "
                        "delayed where --fp8-margin, --fp8-amax-history-len or --fp8-amax-compute-algo is given, "
                        "else tensorwise. mxfp8 and blockwise are refused")
    g.add_argument("--fp8-margin", type=int, default=None,
                   help="delayed scaling: scales divided by 2^margin (headroom; default 0)")
    g.add_argument("--fp8-amax-history-len", type=int, default=None,
                   help="delayed scaling: amaxes kept per fp8 input and output gradient (default 1); saved in "
                        "checkpoints")
    g.add_argument("--fp8-amax-compute-algo", default=None, choices=["most_recent", "max"],
                   help="delayed scaling: each scale from the newest amax (most_recent, the default) or the "
                        "history's largest (max)")
    g = flag_section(parser, "training")
    g.add_argument("--cross-entropy-chunk-size", type=int, default=None,
                   help="tokens per float32 chunk of the output-layer cross entropy, so the full float32 "
                        "logits never exist (0 = off; default 1024 with CUDA, 0 on CPU; under tensor parallelism "
                        "it chunks the vocab-parallel loss)")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_true",
                   help="with --bf16/--fp16 the transformer layers' linear layers compute with a half-precision "
                        "copy of their fp32 weights (refreshed once per step) and their weight-gradient matmuls "
                        "add into the fp32 gradient (default where the model is not FSDP2-sharded, tensor- or "
                        "pipeline-parallel, fp8 or fully recomputed); this flag turns that off: autocast casts "
                        "per micro-batch and autograd adds the gradients")
    g.add_argument("--cuda-graph-impl", default="none", choices=["none", "local", "transformer_engine"],
                   help="local: record each training micro-batch (batch, forward, loss, backward, gradient "
                        "accumulation) as one CUDA graph after the warm-up and replay it (one process on CUDA; not "
                        "with --fp16, recomputation, fp8 or fine-tuning); transformer_engine is refused (no "
                        "Transformer Engine)")
    g.add_argument("--cuda-graph-scope", nargs="+", default=[],
                   help="what the graph holds: full_iteration (the whole micro-batch; the only scope, and the "
                        "default, of --cuda-graph-impl local); the per-layer scopes (attn, mlp, ...) are refused")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                   help="iterations run without the graph before it is recorded (compilation happens there)")
    g.add_argument("--enable-cuda-graph", action="store_true",
                   help="the older name of --cuda-graph-impl local")
