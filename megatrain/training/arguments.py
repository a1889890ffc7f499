"""Megatron-LM compatible command line for pre-training, and its validation.

`build_parser()` holds every flag ``pretrain_gpt.py`` accepts, with Megatron's names,
defaults and attribute names; `parse_args()` parses a command line (plus an optional
``--config run.yaml`` supplying the same fields), rejects unknown flags with a suggestion,
notes legacy flags, and validates the combination before any work starts.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Any, Sequence

from megatrain.data.config import add_data_args
from megatrain.data.tokenizers import add_tokenizer_args

# Flags older scripts and guides pass that mean nothing (or something simpler) here.
# flag -> one-line note printed when it is used.
LEGACY_FLAG_NOTES: dict[str, str] = {
    "--checkpoint-activations": "means --recompute-granularity full --recompute-method uniform here",
    "--distributed-backend": "nccl on CUDA and gloo on CPU are chosen automatically",
    "--num-gpus-per-node": "informational; the launcher (torchrun/SLURM) sets the processes per node",
    "--world-size": "informational; the world size comes from the launcher",
    "--use-flash-attn": "attention always uses PyTorch SDPA, which picks flash attention where it can",
    "--use-mcore-models": "megatrain has one model implementation; the flag changes nothing",
    "--no-masked-softmax-fusion": "attention uses SDPA; softmax fusion is not a separate switch",
    "--no-bias-dropout-fusion": "fusion is left to torch.compile",
    "--DDP-impl": "data parallelism is chosen by --use-distributed-optimizer / --zero-stage",
    "--attention-backend": "attention runs through PyTorch SDPA, which picks the flash / cuDNN / memory-efficient "
                           "kernel itself (a start-up probe warns when only the slow math fallback fits)",
    "--cross-entropy-loss-fusion": "the output layer's cross entropy is fused and chunked by "
                                   "--cross-entropy-chunk-size (on by default with CUDA)",
    "--cross-entropy-fusion-impl": "the output layer's cross entropy is fused and chunked by "
                                   "--cross-entropy-chunk-size (on by default with CUDA)",
    "--no-create-attention-mask-in-dataloader": "masks are built only with --reset-attention-mask; causal "
                                                "attention needs none",
    "--ckpt-format": "checkpoints are PyTorch DCP shards in Megatron's directory layout (like torch_dist), "
                     "whatever the value",
    "--fp8-param-gather": "weights are gathered in bf16 (FSDP2 mixed precision) and cast to fp8 at each matmul: "
                          "the same matmuls, twice the bytes gathered",
    "--no-rope-fusion": "RoPE is fused by torch.compile with the rest of the layer",
    "--use-contiguous-parameters-in-local-ddp": "data parallelism is PyTorch DDP / FSDP2, which lays out its own "
                                                "buckets",
    "--keep_fp8_weight_transpose_cache": "fp8 weights are cast per matmul by torchao; there is no transpose cache",
    "--fp8-interval": "delayed-scaling setting: megatrain's fp8 recomputes every scale at every step",
    "--use-torch-fsdp2": "means --zero-stage 3 here (FSDP2 with parameters, gradients and optimizer state "
                         "sharded), unless --zero-stage / --use-distributed-optimizer say otherwise",
    "--local_rank": "taken from the LOCAL_RANK environment variable",
    "--local-rank": "taken from the LOCAL_RANK environment variable",
    "--no-async-tensor-model-parallel-allreduce": "communication overlap is handled by PyTorch",
    "--async-tensor-model-parallel-allreduce": "communication overlap is handled by PyTorch",
    "--transformer-impl": "megatrain has one transformer implementation (PyTorch)",
    "--use-legacy-models": "megatrain has one model implementation",
    "--apply-query-key-layer-scaling": "softmax is computed in fp32 by SDPA; no extra scaling is needed",
    "--attention-softmax-in-fp32": "softmax is computed in fp32 by SDPA",
    "--log-throughput": "throughput is always logged",
    "--log-timers-to-tensorboard": "iteration time and throughput are always written to TensorBoard",
    "--log-validation-ppl-to-tensorboard": "validation perplexity is always written to TensorBoard",
    "--log-memory-to-tensorboard": "peak memory is always written to TensorBoard on CUDA",
    "--accumulate-allreduce-grads-in-fp32": "gradients are always accumulated and reduced in fp32 "
                                            "(unless --grad-reduce-in-bf16)",
}

# Megatron flags that megatrain knows but does not implement; they are refused with this reason.
UNSUPPORTED_FLAGS: dict[str, str] = {
    "--num-experts": "mixture-of-experts models are not supported yet",
    "--moe-router-topk": "mixture-of-experts models are not supported yet",
    "--expert-model-parallel-size": "mixture-of-experts models are not supported yet",
    "--encoder-num-layers": "encoder-decoder models are not supported",
    "--decoder-num-layers": "use --num-layers",
    "--use-cpu-initialization": None,
    "--spec": "custom layer specs are not supported; the model shape is given by flags",
    "--yaml-cfg": "use --config run.yaml",
    "--retro-project-dir": "RETRO is not supported",
    "--vision-backbone-type": "vision models are not supported",
    "--mtp-num-layers": "multi-token prediction is not supported yet",
    "--multi-latent-attention": "multi-latent attention is not supported yet",
    "--qk-layernorm": "qk-layernorm is not supported yet",
    "--rotary-interleaved": "interleaved rotary embeddings are not supported yet",
    "--use-rotary-position-embeddings": None,
    "--squared-relu": "squared-ReLU activation is not supported yet",
    "--apply-residual-connection-post-layernorm": "post-layernorm residuals are not supported",
}
UNSUPPORTED_FLAGS = {k: v for k, v in UNSUPPORTED_FLAGS.items() if v is not None}


class MegatronArgumentParser(argparse.ArgumentParser):
    """ArgumentParser that refuses unknown flags with a close-match suggestion."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            bad = [tok for tok in message.split(":", 1)[1].split() if tok.startswith("--")]
            known = [opt for act in self._actions for opt in act.option_strings]
            lines = []
            for flag in bad or message.split(":", 1)[1].split():
                name = flag.split("=", 1)[0]
                if name in UNSUPPORTED_FLAGS:
                    lines.append(f"{name}: {UNSUPPORTED_FLAGS[name]}")
                    continue
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]}?)" if close else ""
                lines.append(f"unknown flag {name}{hint}")
            self.exit(2, f"{self.prog}: error: " + "; ".join(lines) + "\n")
        super().error(message)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=None, help="number of transformer layers")
    g.add_argument("--hidden-size", type=int, default=None, help="transformer hidden size")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP hidden size (default 4*hidden, or Megatron's SwiGLU default)")
    g.add_argument("--num-attention-heads", type=int, default=None, help="attention heads")
    g.add_argument("--kv-channels", type=int, default=None, help="head dimension (default hidden/heads)")
    g.add_argument("--group-query-attention", action="store_true", help="use grouped-query attention")
    g.add_argument("--num-query-groups", type=int, default=1, help="query groups with --group-query-attention")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="maximum sequence length for learned positions (default --seq-length)")
    g.add_argument("--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope"])
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="no learned absolute positions (with --position-embedding-type rope there are none anyway)")
    g.add_argument("--rotary-base", type=float, default=10000.0, help="RoPE base period")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of each head's dims that RoPE rotates (the rest pass through)")
    g.add_argument("--fp32-residual-connection", action="store_true",
                   help="keep the residual stream between layers in float32 under bf16/fp16 (default: in the "
                        "half-precision dtype, as Megatron-LM)")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="store norm weights centred on zero; the layers scale by 1 + weight")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this (times TP)")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--layernorm-epsilon", type=float, default=None, help="old name of --norm-epsilon")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (LLaMA style)")
    g.add_argument("--no-bias-gelu-fusion", action="store_true",
                   help="exact (erf) GELU in the MLP; by default, as Megatron-LM's fused bias-GELU, the GELU "
                        "of a model with linear biases is the tanh approximation (torch.compile fuses it)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="no biases in linear layers")
    g.add_argument("--seq-length", type=int, default=None, help="sequence length")


def _add_regularization_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"])
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient clipping on the global L2 norm (0: off)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None, help="batch size per GPU per forward pass")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step (default micro-batch * data-parallel size)")
    g.add_argument("--batch-size", type=int, default=None, help="old name of --micro-batch-size")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="grow the global batch from START by INCREMENT over the first SAMPLES samples "
                        "(needs --train-samples)")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--exit-interval", type=int, default=None, help="exit when iteration %% N == 0")
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true", help="on SIGTERM save and exit cleanly")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="average the loss over all loss tokens of the global batch (default: over each "
                        "micro-batch's tokens, then over micro-batches)")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn off Python's automatic garbage collection during training; collect every "
                        "--manual-gc-interval iterations and around evaluation instead")
    g.add_argument("--manual-gc-interval", type=int, default=0, help="with --manual-gc: collect every N iterations "
                                                                       "(0: only at start and around evaluation)")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="with --manual-gc: do not collect around evaluation")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="release cached CUDA memory: 1 after each step's forward/backward and each evaluation, "
                        "2 also after the optimizer step")
    g.add_argument("--profile", action="store_true",
                   help="record a torch.profiler trace of iterations --profile-step-start to --profile-step-end")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="global ranks to profile")
    g.add_argument("--use-pytorch-profiler", action="store_true", help="the profiler used by --profile (always)")
    g.add_argument("--profile-dir", default=None,
                   help="where --profile writes its trace (default --tensorboard-dir, else ./profile)")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--max-nan-iterations", type=int, default=10,
                   help="stop the run after this many iterations with a NaN/inf loss or gradient")
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
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def _add_init_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("initialization")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--data-parallel-random-init", action="store_true",
                   help="initialise each data-parallel replica with a different seed (Megatron's option)")
    g.add_argument("--init-method-std", type=float, default=0.02)


def _add_lr_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak LR of the input embedding and output layer (their own schedule)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="minimum LR of the input embedding and output layer (default --min-lr)")
    # Megatron-LM's two spellings of each, and the names before its scheduler was renamed.
    g.add_argument("--override-opt-param-scheduler", "--override-opt_param-scheduler", "--override-lr-scheduler",
                   action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on --load, train with the flags' LR and weight-decay schedule where it differs from the "
                        "checkpoint's (the step count is still the checkpoint's); without this flag or "
                        "--use-checkpoint-opt_param-scheduler a difference is refused")
    g.add_argument("--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler",
                   "--use-checkpoint-lr-scheduler", action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="on --load, train with the checkpoint's LR and weight-decay schedule where it differs "
                        "from the flags'")


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None, help="directory to load a checkpoint from")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load weights only; reset iteration and optimizer")
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: stop with an error when no checkpoint is found (default: start fresh)")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model configuration (every value a resume compares: layers, sizes, heads, "
                        "positions, norms, ...) from the --load checkpoint instead of the flags")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background; the loop waits only for a copy to host memory")
    g.add_argument("--keep-last-checkpoints", type=_at_least_one, default=None, metavar="K",
                   help="after each save delete all but the newest K complete checkpoints (default: keep all)")
    g.add_argument("--no-verify-checkpoint-checksums", action="store_true",
                   help="megatrain extension: on --load, check the files' sizes only, not their checksums "
                        "(verifying reads the whole checkpoint once)")
    g.add_argument("--allow-non-finite-checkpoint", action="store_true",
                   help="megatrain extension: load a checkpoint whose model or optimizer state holds NaN/Inf "
                        "(refused by default)")


def _add_mixed_precision_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (default dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--fp8-format", default=None, choices=["e4m3", "hybrid"],
                   help="fp8 matmuls in the transformer layers through torchao (needs --bf16): hybrid = e4m3 "
                        "forward, e5m2 gradients; e4m3 = e4m3 everywhere")
    g.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "delayed", "mxfp8", "blockwise"],
                   help="fp8 scaling: tensorwise (dynamic per-tensor scales). delayed (Megatron's default) runs "
                        "as tensorwise with a note; mxfp8 and blockwise are refused")
    g.add_argument("--fp8-margin", type=int, default=0, help="delayed scaling only (noted, not used)")
    g.add_argument("--fp8-amax-history-len", type=int, default=1, help="delayed scaling only (noted, not used)")
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"],
                   help="delayed scaling only (noted, not used)")


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
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


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--log-throughput", action="store_true", help="always on here")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)


def _add_validation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("validation")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--skip-train", action="store_true")


def _add_legacy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("accepted for compatibility (see the notes printed at start)")
    g.add_argument("--checkpoint-activations", action="store_true")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"])
    g.add_argument("--num-gpus-per-node", type=int, default=None)
    g.add_argument("--world-size", type=int, default=None)
    g.add_argument("--use-flash-attn", action="store_true")
    g.add_argument("--use-mcore-models", action="store_true")
    g.add_argument("--use-legacy-models", action="store_true")
    g.add_argument("--no-masked-softmax-fusion", action="store_true")
    g.add_argument("--no-bias-dropout-fusion", action="store_true")
    g.add_argument("--no-async-tensor-model-parallel-allreduce", action="store_true")
    g.add_argument("--async-tensor-model-parallel-allreduce", action="store_true")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--transformer-impl", default=None, choices=["local", "transformer_engine"])
    g.add_argument("--DDP-impl", default=None, choices=["local", "torch"])
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, dest="local_rank")
    g.add_argument("--attention-backend", default=None, choices=["auto", "flash", "fused", "unfused", "local"])
    g.add_argument("--cross-entropy-loss-fusion", action="store_true")
    g.add_argument("--cross-entropy-fusion-impl", default=None, choices=["native", "te"])
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_true")
    g.add_argument("--fp8-param-gather", action="store_true")
    g.add_argument("--no-rope-fusion", action="store_true")
    g.add_argument("--use-contiguous-parameters-in-local-ddp", action="store_true")
    g.add_argument("--keep_fp8_weight_transpose_cache", "--keep-fp8-weight-transpose-cache", action="store_true",
                   dest="keep_fp8_weight_transpose_cache")
    g.add_argument("--fp8-interval", type=int, default=None)
    g.add_argument("--use-torch-fsdp2", action="store_true")
    g.add_argument("--ckpt-format", default=None, choices=["torch_dist", "torch", "zarr", "torch_dcp", "fsdp_dtensor"])


def build_parser(prog: str = "pretrain_gpt.py") -> MegatronArgumentParser:
    """The full pre-training parser (also used by tools that must share its defaults)."""
    p = MegatronArgumentParser(prog=prog, allow_abbrev=False,
                               description="Pre-train a GPT model with Megatron-LM compatible flags.")
    p.add_argument("--config", default=None, help="YAML file whose keys supply the same fields as the flags")
    _add_model_args(p)
    _add_regularization_args(p)
    _add_training_args(p)
    _add_init_args(p)
    _add_lr_args(p)
    _add_checkpoint_args(p)
    _add_mixed_precision_args(p)
    _add_distributed_args(p)
    _add_logging_args(p)
    _add_validation_args(p)
    add_data_args(p)
    add_tokenizer_args(p)
    _add_legacy_args(p)
    return p


def _yaml_reason(e: Exception) -> str:
    """One line from a PyYAML error: the problem and where it is (its text spans several lines)."""
    problem = getattr(e, "problem", None)
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if problem:
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        context = getattr(e, "context", None)
        return f"{problem}{where}" + (f" ({context})" if context else "")
    return " ".join(str(e).split())


def _config_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """Read ``--config`` YAML; keys are flag names with or without dashes (``num-layers`` or ``num_layers``)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}  # safe_load: plain data only, no Python object tags
    except FileNotFoundError:
        raise SystemExit(f"--config: file not found: {path}")
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"--config: cannot read {path} ({e})")
    except RecursionError:
        raise SystemExit(f"--config: {path} is not valid YAML: collections nested too deeply to parse")
    except yaml.YAMLError as e:
        raise SystemExit(f"--config: {path} is not valid YAML: {_yaml_reason(e)}")
    if not isinstance(data, dict):
        raise SystemExit(f"--config: {path} must hold a mapping of flag names to values")
    dests = {a.dest: a for a in parser._actions}
    by_flag = {opt.lstrip("-"): a for a in parser._actions for opt in a.option_strings}
    out: dict[str, Any] = {}
    for key, value in data.items():
        k = str(key).lstrip("-")
        action = by_flag.get(k) or by_flag.get(k.replace("_", "-")) or dests.get(k.replace("-", "_"))
        if action is None or action.dest == "config":
            known = list(by_flag)
            close = difflib.get_close_matches(k.replace("_", "-"), known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise SystemExit(f"--config: {path}: unknown key {key!r}{hint}")
        if isinstance(action, argparse._StoreFalseAction) and isinstance(value, bool):
            value = not value if k.replace("_", "-") in [o.lstrip("-") for o in action.option_strings] else value
        out[action.dest] = value
    return out


def parse_args(argv: Sequence[str] | None = None, *, validate: bool = True,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``), apply ``--config``, note legacy flags, validate."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = parser or build_parser()
    if "--config" in argv or any(a.startswith("--config=") for a in argv):
        first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        first.add_argument("--config")
        known, _ = first.parse_known_args(argv)
        if known.config:
            parser.set_defaults(**_config_defaults(parser, known.config))
    args = parser.parse_args(argv)
    args.legacy_notes = [f"note: {flag} {note}" for flag, note in LEGACY_FLAG_NOTES.items()
                         if any(a == flag or a.startswith(flag + "=") for a in argv)]
    if getattr(args, "use_checkpoint_args", False):
        _apply_checkpoint_args(args)
    if validate:
        validate_args(args)
    return args


def _fail(message: str) -> None:
    raise SystemExit(f"error: {message}")


def _apply_checkpoint_args(args: argparse.Namespace) -> None:
    """--use-checkpoint-args: the model's shape from the --load checkpoint, overriding the flags."""
    from megatrain.checkpoint import find_checkpoint, read_meta
    from megatrain.models.gpt.checkpoint_compat import CONFIG_CHECKS, checkpoint_gelu_approximation

    # Every model-config field a resume compares (the flags' dests have the same names); the padded
    # vocabulary follows the tokenizer and resume_vocab_size, the GELU is taken below.
    model_args = [name for name, check in CONFIG_CHECKS.items() if check.how == "compare" and name != "vocab_size"]

    if not args.load:
        _fail("--use-checkpoint-args needs --load")
    # Only meta.json is read here (every process on its own, before torch.distributed starts); the
    # trainer verifies the checkpoint's checksums before loading it, its ranks sharing the reads.
    ckpt = find_checkpoint(args.load, args.ckpt_step, verify=False)
    if ckpt is None:
        _fail(f"--use-checkpoint-args: no checkpoint found in --load {args.load}")
    meta = read_meta(ckpt)
    config = meta.get("model_config", {})
    taken = []
    for name in model_args:
        if name in config and getattr(args, name, None) != config[name]:
            taken.append(f"--{name.replace('_', '-')} {config[name]}")
            setattr(args, name, config[name])
    args.group_query_attention = config.get("num_query_groups") != config.get("num_attention_heads")
    exact_gelu = checkpoint_gelu_approximation(config) == "none"  # a checkpoint from before the field: exact
    gelu_mlp_with_bias = config and not config.get("swiglu") and config.get("add_bias_linear", True)
    if gelu_mlp_with_bias and bool(getattr(args, "no_bias_gelu_fusion", False)) != exact_gelu:
        taken.append("--no-bias-gelu-fusion" if exact_gelu else "tanh-approximated GELU (no --no-bias-gelu-fusion)")
        args.no_bias_gelu_fusion = exact_gelu
    saved = meta.get("args", {})
    if args.seq_length is None and saved.get("seq_length"):
        args.seq_length = saved["seq_length"]
        taken.append(f"--seq-length {args.seq_length}")
    args.legacy_notes.append(f"note: --use-checkpoint-args took the model shape from {ckpt}"
                             + (f": {', '.join(taken)}" if taken else " (the flags already matched)"))


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _validate_cuda_graph(args: argparse.Namespace) -> None:
    """--cuda-graph-impl / --enable-cuda-graph: what a recorded micro-batch can hold."""
    if args.enable_cuda_graph and args.cuda_graph_impl == "none":
        args.cuda_graph_impl = "local"
    impl = args.cuda_graph_impl
    if impl == "none":
        if args.cuda_graph_scope:
            _fail("--cuda-graph-scope needs --cuda-graph-impl local")
        return
    if impl == "transformer_engine":
        _fail("--cuda-graph-impl transformer_engine needs NVIDIA Transformer Engine, which megatrain does not use; "
              "--cuda-graph-impl local records each whole training micro-batch as a CUDA graph")
    other = [s for s in args.cuda_graph_scope if s != "full_iteration"]
    if other:
        _fail(f"--cuda-graph-scope {' '.join(other)}: megatrain records the whole micro-batch (full_iteration), "
              "not parts of layers")
    if args.cuda_graph_warmup_steps < 1:
        _fail(f"--cuda-graph-warmup-steps must be at least 1 (the first iteration compiles), got "
              f"{args.cuda_graph_warmup_steps}")
    if not _runs_on_cuda(args):
        _fail("--cuda-graph-impl local records CUDA graphs: it needs a CUDA device")
    refused = [(args.world_size_actual > 1, f"{args.world_size_actual} processes (tensor/pipeline/context/data "
                                            "parallelism communicate between the graph's kernels)"),
               (args.fp16, "--fp16 (the dynamic loss scale changes between iterations)"),
               (args.recompute_granularity is not None, f"--recompute-granularity {args.recompute_granularity}"),
               (args.fp8_format is not None, f"--fp8-format {args.fp8_format}")]
    given = [why for bad, why in refused if bad]
    if given:
        _fail(f"--cuda-graph-impl local is not supported with {', '.join(given)}; it records the micro-batch of "
              "one process training in bf16/fp32")


def _runs_on_cuda(args: argparse.Namespace) -> bool:
    device = getattr(args, "device", None)
    if device is not None:
        return str(device).startswith("cuda")
    import torch

    return torch.cuda.is_available()


CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")


def _resolve_speed_defaults(args: argparse.Namespace) -> None:
    """--use-torch-compile and --cross-entropy-chunk-size: on by default with CUDA, off on CPU."""
    on_cuda = _runs_on_cuda(args)
    if getattr(args, "use_torch_compile", None) is None:
        args.use_torch_compile = on_cuda
    chunk = getattr(args, "cross_entropy_chunk_size", None)
    if chunk is None:
        args.cross_entropy_chunk_size = 1024 if on_cuda else 0
    elif chunk < 0:
        _fail(f"--cross-entropy-chunk-size must be >= 0 (0 turns chunking off), got {chunk}")


def _validate_fp8(args: argparse.Namespace) -> None:
    """--fp8-*: dynamic tensorwise scaling through torchao, with --bf16."""
    delayed = [f"{flag} {value}" for flag, value, default in (
        ("--fp8-margin", args.fp8_margin, 0), ("--fp8-amax-history-len", args.fp8_amax_history_len, 1),
        ("--fp8-amax-compute-algo", args.fp8_amax_compute_algo, "most_recent")) if value != default]
    if args.fp8_format is None:
        if delayed or args.fp8_recipe != "tensorwise":
            _fail(f"{', '.join(delayed) or '--fp8-recipe ' + args.fp8_recipe} has no effect without --fp8-format")
        return
    if args.fp8_recipe in ("mxfp8", "blockwise"):
        _fail(f"--fp8-recipe {args.fp8_recipe} is not supported: megatrain's fp8 (torchao) scales per tensor; "
              "use --fp8-recipe tensorwise (the default here)")
    if args.fp8_recipe == "delayed" or delayed:
        args.legacy_notes = getattr(args, "legacy_notes", []) + [
            f"note: {', '.join((['--fp8-recipe delayed'] if args.fp8_recipe == 'delayed' else []) + delayed)}: "
            "megatrain's fp8 scales every tensor from its own current absolute maximum (dynamic tensorwise "
            "scaling), so delayed scaling's amax history and margin are not used"]
    if not args.bf16:
        _fail("--fp8-format needs --bf16 (the matmuls outside the fp8 layers and the activations run in bf16)")
    from megatrain.runtime.fp8 import fp8_available

    if not fp8_available():
        _fail("--fp8-format needs torchao (float8 training), which is not installed: pip install 'megatrain[fp8]'")


def _validate_pipeline(args: argparse.Namespace) -> None:
    """Pipeline flags: the layer split divides, the schedule exists, enough micro-batches for it."""
    pipeline_flags = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                      "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                      "pipeline_schedule")
    pp = args.pipeline_model_parallel_size
    if pp == 1:
        given = [f"--{f.replace('_', '-')}" for f in pipeline_flags if getattr(args, f, None) is not None]
        if given:
            _fail(f"{', '.join(given)} need --pipeline-model-parallel-size > 1")
        return
    from megatrain.parallel.pipeline import PipelineConfig, split_layers

    try:
        cfg = PipelineConfig.from_args(args)
        split_layers(args.num_layers, pp, cfg.virtual_stages, cfg.first_stage_layers, cfg.last_stage_layers)
    except ValueError as e:
        _fail(str(e))
    if cfg.schedule in ("1f1b", "gpipe") and args.num_micro_batches < pp:
        _fail(f"--pipeline-schedule {cfg.schedule} needs at least --pipeline-model-parallel-size ({pp}) "
              f"micro-batches per iteration, got {args.num_micro_batches} (--global-batch-size "
              f"{args.global_batch_size} / (--micro-batch-size {args.micro_batch_size} x data-parallel size "
              f"{args.data_parallel_size})); raise --global-batch-size")


def validate_args(args: argparse.Namespace, world_size: int | None = None) -> argparse.Namespace:
    """Check flag combinations (clear messages naming the flags) and fill derived values."""
    world_size = world_size_from_env() if world_size is None else world_size
    # Old spellings.
    if args.layernorm_epsilon is not None:
        args.norm_epsilon = args.layernorm_epsilon
    if args.batch_size is not None:
        if args.micro_batch_size is not None and args.micro_batch_size != args.batch_size:
            _fail("--batch-size is the old name of --micro-batch-size; give only one of them")
        args.micro_batch_size = args.batch_size
    if args.checkpoint_activations:
        args.recompute_granularity = "full"
        args.recompute_method = args.recompute_method or "uniform"
        args.recompute_num_layers = args.recompute_num_layers or 1
    if args.recompute_granularity == "full" and args.recompute_method is None:
        args.recompute_method = "uniform"
        args.recompute_num_layers = args.recompute_num_layers or 1

    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size"):
        if getattr(args, flag) is None:
            _fail(f"--{flag.replace('_', '-')} is required")
        if getattr(args, flag) <= 0:
            _fail(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        _fail(f"--hidden-size ({args.hidden_size}) must be divisible by "
              f"--num-attention-heads ({args.num_attention_heads})")
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    elif args.num_attention_heads % args.num_query_groups:
        _fail(f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
              f"--num-query-groups ({args.num_query_groups})")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > args.max_position_embeddings:
        _fail(f"--seq-length ({args.seq_length}) is larger than --max-position-embeddings "
              f"({args.max_position_embeddings})")

    if args.fp16 and args.bf16:
        _fail("--fp16 and --bf16 cannot be used together")
    _validate_fp8(args)
    _resolve_speed_defaults(args)
    if (args.train_iters is None) == (args.train_samples is None):
        _fail("give exactly one of --train-iters and --train-samples")
    if args.lr is None:
        _fail("--lr is required")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        _fail("give only one of --override-opt_param-scheduler (the flags' schedule wins) and "
              "--use-checkpoint-opt_param-scheduler (the checkpoint's wins)")
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        _fail("give only one of --lr-warmup-fraction and --lr-warmup-iters")

    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if cp < 1:
        _fail(f"--context-parallel-size must be at least 1, got {cp}")
    if cp > 1:
        if args.seq_length % (2 * cp):
            _fail(f"--context-parallel-size {cp} cuts each sequence into {2 * cp} chunks: --seq-length "
                  f"({args.seq_length}) must be divisible by {2 * cp}")
        if args.reset_attention_mask:
            _fail("--context-parallel-size > 1 with --reset-attention-mask (document masks) is not supported yet")
    for name, size in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp)):
        if size < 1:
            _fail(f"{name} must be at least 1, got {size}")
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        _fail(f"world size ({world_size}) is not divisible by --tensor-model-parallel-size ({tp}) x "
              f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp})")
    args.world_size_actual = world_size
    args.data_parallel_size = world_size // model_parallel
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False
    if args.tp_comm_overlap:
        if tp == 1:
            args.tp_comm_overlap = False
            args.legacy_notes.append("note: --tp-comm-overlap has no effect without tensor parallelism")
        elif not args.sequence_parallel:
            _fail("--tp-comm-overlap overlaps the sequence-parallel collectives with the GEMMs: it needs "
                  "--sequence-parallel")
        elif not (args.use_torch_compile and _runs_on_cuda(args)):
            args.tp_comm_overlap = False
            args.legacy_notes.append("note: --tp-comm-overlap needs CUDA and --use-torch-compile (async TP is an "
                                     "inductor pass); this run communicates without overlap")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % (args.micro_batch_size * args.data_parallel_size):
        _fail(f"--global-batch-size ({args.global_batch_size}) must be a multiple of --micro-batch-size "
              f"({args.micro_batch_size}) x data-parallel size ({args.data_parallel_size})")
    args.num_micro_batches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    _validate_pipeline(args)
    if args.rampup_batch_size is not None:
        if args.train_samples is None:
            _fail("--rampup-batch-size needs sample-based training: give --train-samples instead of --train-iters "
                  "(as Megatron-LM requires)")
        per_micro = args.micro_batch_size * args.data_parallel_size
        if pp > 1 and any((v // per_micro) % pp for v in args.rampup_batch_size[:2] if v % per_micro == 0):
            _fail(f"--rampup-batch-size with --pipeline-model-parallel-size {pp}: the start and increment must be "
                  f"whole multiples of {pp} micro-batches ({pp} x --micro-batch-size x data-parallel size = "
                  f"{pp * per_micro} samples), so that every batch of the ramp fills the pipeline schedule")
        from megatrain.training.batch_rampup import BatchRampup

        try:
            rampup = BatchRampup(*args.rampup_batch_size, args.global_batch_size,
                                 args.micro_batch_size * args.data_parallel_size)
        except ValueError as e:
            _fail(str(e))
        args.train_iters_derived = rampup.iterations_for(args.train_samples)
    elif args.train_samples is not None:
        args.train_iters_derived = args.train_samples // args.global_batch_size
    else:
        args.train_iters_derived = args.train_iters
    if args.use_distributed_optimizer and args.zero_stage == 0:
        args.zero_stage = 1
    if args.use_torch_fsdp2 and args.zero_stage == 0:
        args.zero_stage = 3
    if args.dataloader_type == "external":
        _fail("--dataloader-type external (a loader the script supplies) is not supported; megatrain reads "
              "--data-path / --mock-data itself")
    if not args.add_position_embedding and args.position_embedding_type == "learned_absolute":
        _fail("--no-position-embedding without --position-embedding-type rope would leave the model without "
              "positions, which is not supported; use --position-embedding-type rope")
    from megatrain.parallel.parallelize import whole_model_compile_allowed

    whole_model_ok = whole_model_compile_allowed(tp=tp, pp=pp, cp=cp, sharded_data_parallel=args.zero_stage > 0)
    if args.torch_compile_scope == "auto":
        # fp8 compiles per layer: its whole-model graph took 98 s to the first iteration on an H200
        args.torch_compile_scope = "model" if whole_model_ok and args.fp8_format is None else "layer"
    if args.torch_compile_scope == "model" and not whole_model_ok:
        _fail("--torch-compile-scope model compiles the whole model of one process or of a replicated (DDP) "
              f"data-parallel run; with --tensor-model-parallel-size {tp}, --pipeline-model-parallel-size {pp}, "
              f"--context-parallel-size {cp}"
              f"{', --use-distributed-optimizer / --zero-stage' if args.zero_stage else ''} use "
              "--torch-compile-scope layer")
    if args.use_torch_compile and args.torch_compile_mode in CUDA_GRAPH_COMPILE_MODES:
        _fail(f"--torch-compile-mode {args.torch_compile_mode} records CUDA graphs, which training does not "
              "support: torch's CUDA graph trees overwrite the activations a micro-batch saved for its backward "
              "(measured on an H200, torch 2.11; pytorch/pytorch#169545); use --torch-compile-mode default or "
              "max-autotune-no-cudagraphs; --cuda-graph-impl local records whole micro-batches instead")
    _validate_cuda_graph(args)
    if args.eval_interval is not None and args.eval_interval <= 0:
        _fail(f"--eval-interval must be positive, got {args.eval_interval}")
    if args.log_interval <= 0:
        _fail(f"--log-interval must be positive, got {args.log_interval}")
    if args.save_interval is not None and args.save_interval <= 0:
        _fail(f"--save-interval must be positive, got {args.save_interval}")

    has_data = bool(args.data_path) or bool(args.train_data_path)
    if not has_data and not args.mock_data:
        _fail("no training data: give --data-path (or --train-data-path), or --mock-data for synthetic tokens")
    if args.data_path and args.train_data_path:
        _fail("give either --data-path or --train-data-path/--valid-data-path/--test-data-path, not both")
    return args
