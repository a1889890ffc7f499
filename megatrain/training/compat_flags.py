"""Megatron-LM flags that mean nothing (or something simpler) here, and those that are refused.

`add_compat_flags` accepts the first kind so that old scripts run; `parse_args` prints each one's
note from `LEGACY_FLAG_NOTES`. `UNSUPPORTED_FLAGS` are not flags of the parser: the parser refuses
them with the reason given here. docs/megatron_flags.md lists both (`megatrain.training.flag_table`).
"""

from __future__ import annotations

import argparse

from megatrain.flags import flag_section

__all__ = ["LEGACY_FLAG_NOTES", "UNSUPPORTED_FLAGS", "COMPAT_SECTION", "add_compat_flags"]

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
    "--attention-backend": "GPT and BERT attention runs through PyTorch SDPA, which picks the flash / cuDNN / "
                           "memory-efficient kernel itself (a start-up probe warns when only the slow math fallback "
                           "fits); megatrain's own value flex trains T5 through FlexAttention (the relative-position "
                           "bias as a score_mod; measured slower than SDPA on an H200, so not the default)",
    "--cross-entropy-loss-fusion": "the output layer's cross entropy is fused and chunked by "
                                   "--cross-entropy-chunk-size (on by default with CUDA)",
    "--cross-entropy-fusion-impl": "the output layer's cross entropy is fused and chunked by "
                                   "--cross-entropy-chunk-size (on by default with CUDA)",
    "--no-create-attention-mask-in-dataloader": "masks are built only with --reset-attention-mask; causal "
                                                "attention needs none",
    "--ckpt-format": "checkpoints are PyTorch DCP shards in Megatron's directory layout (like torch_dist), "
                     "whatever the value; tools/checkpoint/convert.py --saver mcore (or megatron) writes one as "
                     "Megatron-LM's torch_dist (or torch) format, and --load reads Megatron-LM's",
    "--auto-detect-ckpt-format": "is always on here: --load reads megatrain's checkpoints and Megatron-LM's "
                                 "torch_dist and legacy torch ones, whatever --ckpt-format says",
    "--fp8-param-gather": "weights are gathered in bf16 (FSDP2 mixed precision) and cast to fp8 at each matmul: "
                          "the same matmuls, twice the bytes gathered",
    "--no-rope-fusion": "RoPE is fused by torch.compile with the rest of the layer",
    "--use-contiguous-parameters-in-local-ddp": "data parallelism is PyTorch DDP / FSDP2, which lays out its own "
                                                "buckets",
    "--keep_fp8_weight_transpose_cache": ("megatrain's fp8 layers cast each weight once per optimizer step in both "
                                         "layouts (the transpose kept for the step); torchao's layers cast per matmul"),
    "--fp8-interval": "deprecated in Megatron (Transformer Engine no longer reads it): delayed scaling here "
                      "updates each scale after every micro-batch, as Transformer Engine does",
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
    "--dataset-impl": "old name of the data format: megatrain reads Megatron's mmap .bin/.idx files (mmap and "
                      "infer mean that; lazy and cached are refused)",
    "--data-impl": "old name of the data format: megatrain reads Megatron's mmap .bin/.idx files (mmap and "
                   "infer mean that; lazy and cached are refused)",
    "--activations-checkpoint-method": "old name of --recompute-method (it implies --recompute-granularity full, "
                                       "as in the Megatron-LM versions that had it)",
    "--activations-checkpoint-num-layers": "old name of --recompute-num-layers",
    "--warmup": "old Megatron-LM's warm-up, a fraction of the decay iterations: means --lr-warmup-fraction",
    "--recompute-activations": "means --recompute-granularity selective (as in Megatron-LM)",
    "--use-megatron-fsdp": "data parallelism is PyTorch FSDP2: --data-parallel-sharding-strategy optim / "
                           "optim_grads / optim_grads_params (the default) mean --zero-stage 1 / 2 / 3, no_shard "
                           "means replicated data parallelism",
    "--use-custom-fsdp": "old name of --use-megatron-fsdp: data parallelism is PyTorch FSDP2 (--zero-stage from "
                         "--data-parallel-sharding-strategy)",
    "--data-parallel-sharding-strategy": "optim / optim_grads / optim_grads_params mean --zero-stage 1 / 2 / 3 "
                                         "with --use-megatron-fsdp (no effect without it, as in Megatron-LM)",
    "--torch-fsdp2-no-reshard-after-forward": "with --use-torch-fsdp2: --zero-stage 2 (parameters gathered once "
                                              "per step, not resharded after the forward)",
    "--init-model-with-meta-device": "the model is always built on the meta device and materialised shard by "
                                     "shard",
    "--megatron-fsdp-version": "data parallelism is PyTorch FSDP2 (--zero-stage)",
    "--outer-dp-sharding-strategy": "hybrid sharding (HSDP) is not separate here: sharding spans all "
                                    "data-parallel ranks (no_shard only is accepted)",
    "--num-distributed-optimizer-instances": "the optimizer state is sharded over all data-parallel ranks "
                                             "(1 only is accepted)",
    "--megatron-fsdp-main-params-dtype": "master weights are fp32 (fp32 / auto accepted)",
    "--megatron-fsdp-main-grads-dtype": "gradients are accumulated in fp32 (bf16 means --grad-reduce-in-bf16)",
    "--megatron-fsdp-grad-comm-dtype": "gradients are reduced in fp32 (bf16 means --grad-reduce-in-bf16)",
    # Megatron-FSDP performance switches: FSDP2 manages its own buffers and communication.
    **{flag: "a Megatron-FSDP buffer/communication tuning switch; FSDP2 manages its own (no effect)"
       for flag in ("--fsdp-double-buffer", "--use-nccl-ub", "--disable-symmetric-registration",
                    "--fsdp-manual-registration", "--create-all-gather-group", "--suggested-communication-unit-size",
                    "--keep-fp8-transpose-cache", "--enable-full-sharding-in-hsdp",
                    "--megatron-fsdp-enable-fine-grained-param-gather", "--megatron-fsdp-max-pool-double-buffer",
                    "--fsdp-db-use-persist-buf-on-alloc-fail", "--no-gradient-reduce-div-fusion")},
    # Megatron's MoE kernel-fusion and overlap switches: the same numbers, left to PyTorch here.
    "--mla-down-proj-fusion": "multi-latent attention's down projections are plain linears (torch.compile may "
                              "fuse them)",
    "--moe-permute-fusion": "token permutation is plain PyTorch (torch.compile may fuse it)",
    "--moe-router-fusion": "the router's top-k and scores are plain PyTorch (torch.compile may fuse them)",
    "--moe-shared-expert-overlap": "the shared experts run after the routed ones, without a separate stream",
    "--moe-use-legacy-grouped-gemm": "the experts' grouped matmul is chosen by --moe-grouped-gemm",
    "--moe-router-padding-for-fp8": "expert inputs are not padded for fp8 (experts stay out of fp8 conversion)",
    "--moe-router-padding-for-quantization": "expert inputs are not padded for fp8 (experts stay out of fp8 "
                                             "conversion)",
    "--moe-flex-dispatcher-backend": "is not used: the flex dispatcher runs as alltoall here (PyTorch all-to-all "
                                     "collectives move the same tokens, the same numbers), not on DeepEP, HybridEP "
                                     "or NCCL EP kernels; without --moe-token-dispatcher-type flex it has no effect, "
                                     "as in Megatron-LM",
    "--enable-experimental": "changes nothing: megatrain has no experimental switch, each feature is on or off by "
                             "its own flags",
}

# Megatron flags that megatrain knows but does not implement; they are refused with this reason.
UNSUPPORTED_FLAGS: dict[str, str] = {
    "--spec": "custom layer specs are not supported; the model shape is given by flags",
    "--yaml-cfg": "use --config run.yaml",
    "--retro-project-dir": "RETRO is not supported",
    "--vision-backbone-type": "vision models are not supported",
    "--mtp-hsm": "hidden state mixing of the multi-token prediction depths' inputs is not supported",
    "--moe-use-upcycling": "upcycling a dense checkpoint into a MoE model is not supported",
    "--moe-router-topk-limited-devices": "deprecated in Megatron-LM: use --moe-router-num-groups (the expert-parallel "
                                         "size) and --moe-router-group-topk",
    "--cache-mla-latents": "the KV cache holds multi-latent attention's up-projected keys and values; caching "
                           "the latents (weight absorption) is not implemented",
    "--use-rotary-position-embeddings": None,
    "--squared-relu": "squared-ReLU activation is not supported yet",
    "--apply-residual-connection-post-layernorm": "post-layernorm residuals are not supported",
    # BERT's and T5's own flags (pretrain_bert.py / pretrain_t5.py know them): pretrain_gpt.py points there.
    "--bert-no-binary-head": "a BERT flag: train BERT with pretrain_bert.py",
    "--mask-prob": "a masked-LM data flag: train BERT with pretrain_bert.py, T5 with pretrain_t5.py",
    "--short-seq-prob": "a masked-LM data flag: train BERT with pretrain_bert.py, T5 with pretrain_t5.py",
    "--encoder-num-layers": "a T5 (encoder-decoder) flag: train T5 with pretrain_t5.py",
    "--decoder-num-layers": "a T5 (encoder-decoder) flag: train T5 with pretrain_t5.py",
    "--encoder-seq-length": "a T5 (encoder-decoder) flag: train T5 with pretrain_t5.py",
    "--decoder-seq-length": "a T5 (encoder-decoder) flag: train T5 with pretrain_t5.py",
    "--relative-attention-num-buckets": "a T5 flag (relative position bias): train T5 with pretrain_t5.py",
    "--relative-attention-max-distance": "a T5 flag (relative position bias): train T5 with pretrain_t5.py",
}
UNSUPPORTED_FLAGS = {k: v for k, v in UNSUPPORTED_FLAGS.items() if v is not None}

COMPAT_SECTION = "accepted for compatibility (see the notes printed at start)"


def add_compat_flags(parser: argparse.ArgumentParser) -> None:
    """Add the flags accepted only for compatibility (their notes are in `LEGACY_FLAG_NOTES`)."""
    g = flag_section(parser, COMPAT_SECTION)
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
    g.add_argument("--attention-backend", default=None, choices=["auto", "flash", "fused", "unfused", "local", "flex"])
    g.add_argument("--cross-entropy-loss-fusion", action="store_true")
    g.add_argument("--cross-entropy-fusion-impl", default=None, choices=["native", "te"])
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_true")
    g.add_argument("--fp8-param-gather", action="store_true")
    g.add_argument("--auto-detect-ckpt-format", action="store_true")
    g.add_argument("--no-rope-fusion", action="store_true")
    g.add_argument("--use-contiguous-parameters-in-local-ddp", action="store_true")
    g.add_argument("--keep_fp8_weight_transpose_cache", "--keep-fp8-weight-transpose-cache", action="store_true",
                   dest="keep_fp8_weight_transpose_cache")
    g.add_argument("--fp8-interval", type=int, default=None)
    g.add_argument("--use-torch-fsdp2", action="store_true")
    g.add_argument("--dataset-impl", "--data-impl", default=None, choices=["mmap", "infer", "lazy", "cached"],
                   dest="dataset_impl")
    g.add_argument("--activations-checkpoint-method", default=None, choices=["uniform", "block"])
    g.add_argument("--activations-checkpoint-num-layers", type=int, default=None)
    g.add_argument("--warmup", type=float, default=None)
    g.add_argument("--recompute-activations", action="store_true")
    g.add_argument("--use-megatron-fsdp", "--use-custom-fsdp", action="store_true", dest="use_megatron_fsdp")
    g.add_argument("--data-parallel-sharding-strategy", default=None,
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    g.add_argument("--torch-fsdp2-no-reshard-after-forward", action="store_false",
                   dest="torch_fsdp2_reshard_after_forward")
    g.add_argument("--init-model-with-meta-device", action="store_true")
    g.add_argument("--megatron-fsdp-version", type=int, default=None, choices=[1, 2])
    g.add_argument("--outer-dp-sharding-strategy", default=None, choices=["no_shard", "optim"])
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=None)
    for name in ("main-params", "main-grads", "grad-comm"):
        g.add_argument(f"--megatron-fsdp-{name}-dtype", default=None, choices=["fp32", "bf16", "fp16", "auto"])
    for flag in ("--fsdp-double-buffer", "--use-nccl-ub", "--disable-symmetric-registration",
                 "--fsdp-manual-registration", "--create-all-gather-group", "--keep-fp8-transpose-cache",
                 "--enable-full-sharding-in-hsdp", "--megatron-fsdp-enable-fine-grained-param-gather",
                 "--megatron-fsdp-max-pool-double-buffer", "--fsdp-db-use-persist-buf-on-alloc-fail",
                 "--no-gradient-reduce-div-fusion"):
        g.add_argument(flag, action="store_true", dest="compat_" + flag.lstrip("-").replace("-", "_"))
    g.add_argument("--suggested-communication-unit-size", type=int, default=None)
    for flag in ("--mla-down-proj-fusion", "--moe-permute-fusion", "--moe-router-fusion", "--moe-shared-expert-overlap",
                 "--moe-use-legacy-grouped-gemm", "--moe-router-padding-for-fp8",
                 "--moe-router-padding-for-quantization"):
        g.add_argument(flag, action="store_true", dest="compat_" + flag.lstrip("-").replace("-", "_"))
    g.add_argument("--moe-flex-dispatcher-backend", default="deepep", choices=["deepep", "hybridep", "ncclep"])
    g.add_argument("--enable-experimental", action="store_true")
    g.add_argument("--ckpt-format", default=None, choices=["torch_dist", "torch", "zarr", "torch_dcp", "fsdp_dtensor"])
