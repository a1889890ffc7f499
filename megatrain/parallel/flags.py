"""Parallelism flags, with Megatron-LM's names, defaults and attribute names.

``distributed``: the tensor / pipeline / context parallel sizes, the pipeline's layer split and
schedule, sequence parallelism, data parallelism (DDP or FSDP2 ZeRO stages) and the process-group
timeout; ``training``: activation recomputation and ``torch.compile``, which the parallelize step
applies; ``mixed precision``: the data-parallel gradient reduction dtype.
`megatrain.training.run_config.RunConfig.from_args` turns them into the typed configs of
`megatrain.parallel` (which never sees the namespace).
"""

from __future__ import annotations

import argparse

from megatrain.flags import flag_section

__all__ = ["add_parallel_flags"]


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    """Add the parallelism, recomputation and compilation flags to ``parser``."""
    g = flag_section(parser, "distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--encoder-pipeline-model-parallel-size", type=int, default=0,
                   help="pretrain_vlm.py: 1 puts the vision encoder and projector on a pipeline stage of their own "
                        "before the --pipeline-model-parallel-size stages of the language model (Megatron's; "
                        "other scripts refuse it)")
    g.add_argument("--encoder-tensor-model-parallel-size", type=int, default=0,
                   help="pretrain_vlm.py: the vision encoder's tensor-parallel size, 0 (the same) up to "
                        "--tensor-model-parallel-size; megatrain replicates the encoder on the tensor-parallel "
                        "ranks whatever the value (the same numbers)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="transformer layers on the first pipeline stage (uneven stages)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="transformer layers on the last pipeline stage (uneven stages)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per virtual stage: interleaved 1F1B with (layers / pp) / N stages per rank")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="model chunks per pipeline rank for the interleaved schedule")
    g.add_argument("--pipeline-schedule", default=None,
                   help="1f1b (default), interleaved-1f1b (default with virtual stages), "
                        "interleaved-zero-bubble or gpipe")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split every sequence over this many ranks (load-balanced chunks; attention gathers "
                        "keys and values)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="split each mixture-of-experts layer's experts over this many ranks of a pipeline stage "
                        "(folded over the data x context x tensor parallel ranks)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="1, or the tensor-parallel size (runs as 1): experts are not split over tensor-parallel "
                        "ranks (Megatron's default, the tensor-parallel size, gives the same numbers)")
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall", "flex"],
                   help="how tokens reach their experts' ranks: all-gather then reduce-scatter over the expert "
                        "ranks, or all-to-all of the routed tokens; flex (Megatron's DeepEP / HybridEP dispatcher, "
                        "which moves the same tokens) runs as alltoall, with a note")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="overlap the sequence-parallel all-gathers and reduce-scatters with the GEMMs through "
                        "torch's async tensor parallelism (inductor's micro-pipeline TP over symmetric memory); "
                        "needs --sequence-parallel, and CUDA with --use-torch-compile to take effect")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g = flag_section(parser, "training")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="*", default=None, metavar="MODULE",
                   help="with --recompute-granularity selective: what to recompute, of core_attn (the default), "
                        "mlp, moe, shared_experts")
    g.add_argument("--moe-layer-recompute", action="store_true",
                   help="recompute the mixture-of-experts layers' MLP (router, dispatch, experts) in the backward "
                        "pass")
    g.add_argument("--use-torch-compile", action="store_true", default=None,
                   help="compile each transformer layer (default: on with CUDA, off on CPU)")
    g.add_argument("--no-torch-compile", action="store_false", dest="use_torch_compile", default=None)
    g.add_argument("--torch-compile-scope", default="auto", choices=["auto", "layer", "model"],
                   help="compile the whole model as one region (one process or replicated data parallel, "
                        "not with TP, PP, CP or ZeRO), or each transformer layer; auto (default): the whole "
                        "model where that is allowed and fp8 is off, else each layer")
    g.add_argument("--torch-compile-mode", default="default",
                   choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                   help="torch.compile mode of the compiled region(s); the CUDA-graph modes (reduce-overhead, "
                        "max-autotune) are refused in training (--cuda-graph-impl local is the way to CUDA graphs)")
    g = flag_section(parser, "mixed precision")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
