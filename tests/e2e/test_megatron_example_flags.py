"""Megatron-LM's own example scripts' flags run here: the Llama-3 8B fp8 example
(examples/llama/train_llama3_8b_h100_fp8.sh) with only the sizes shrunk to run on a CPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import cpu_env, run_cmd

REPO = Path(__file__).resolve().parents[2]

# (CPU fp8 matmuls are torch's slow reference kernel: the smallest sizes fp8 accepts, multiples of 16.)
SHRUNK = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
          "--max-position-embeddings", "32", "--ffn-hidden-size", "64", "--num-query-groups", "2",
          "--kv-channels", "8", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", "24",
          "--lr-decay-samples", "20", "--lr-warmup-samples", "4", "--vocab-size", "1000", "--device", "cpu",
          "--eval-iters", "2", "--eval-interval", "3", "--save-interval", "3", "--profile-step-start", "2",
          "--profile-step-end", "4"]
# The example's other flags, as it passes them.
EXAMPLE = ("--use-mcore-models --group-query-attention --position-embedding-type rope --rotary-base 1000000 "
           "--rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 "
           "--attention-backend fused --apply-layernorm-1p --untie-embeddings-and-output-weights "
           "--disable-bias-linear --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 "
           "--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 "
           "--grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc "
           "--empty-unused-memory-level 1 --exit-duration-in-mins 235 --fp8-format hybrid "
           "--fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather "
           "--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel "
           "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --mock-data "
           "--tokenizer-type NullTokenizer --tiktoken-pattern v2 --split 99,1,0 "
           "--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 --log-interval 1 "
           "--log-throughput --profile --ckpt-format torch_dist --distributed-timeout-minutes 60").split()


@pytest.mark.slow
def test_megatron_llama3_fp8_example_flags_run(tmp_path):
    pytest.importorskip("torchao.float8")
    out = tmp_path / "run"
    paths = ["--save", str(out / "ckpt"), "--load", str(out / "ckpt"), "--tensorboard-dir", str(out / "tb"),
             "--data-cache-path", str(out / "cache")]
    proc = run_cmd([sys.executable, "pretrain_gpt.py", *EXAMPLE, *SHRUNK, *paths], env=cpu_env(), timeout=600)
    log = proc.stdout
    assert "] iteration        6/       6 |" in log and "validation loss at iteration 6" in log
    assert "fp8 (hybrid: e4m3 forward, e5m2 gradients" in log and "8 linear layers" in log
    for note in ("--attention-backend", "--fp8-param-gather", "--ckpt-format",
                 # the history flags select delayed scaling, which torchao's layers (FSDP2 here) do not have
                 "--fp8-recipe delayed: torchao's fp8 layers"):
        assert f"note: {note}" in log, note
    assert (out / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert (out / "tb" / "trace_rank0_iters2-4.json").stat().st_size > 0


# Megatron-LM's examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh: its bash arrays expand
# unquoted, so "--split '99,1,0'" reaches the parser with the quotes.
MEGATRON_FSDP = ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
                 "--no-gradient-accumulation-fusion --calculate-per-token-loss --init-model-with-meta-device "
                 "--ckpt-format fsdp_dtensor --use-nccl-ub --fsdp-double-buffer --fsdp-manual-registration "
                 "--no-check-for-nan-in-loss-and-grad").split() + ["--split", "'99,1,0'"]


def test_megatron_fsdp_example_flags_are_accepted():
    pytest.importorskip("torchao.float8")
    from megatrain.data.dataset_builder import parse_split
    from megatrain.training.arguments import parse_args

    example = [f for f in EXAMPLE if f != "--split" and f != "99,1,0"]
    args = parse_args([*example, *SHRUNK, *MEGATRON_FSDP])
    assert args.zero_stage == 3 and not args.check_for_nan_in_loss_and_grad
    assert parse_split(args.split) == pytest.approx([0.99, 0.01, 0.0])
    notes = "\n".join(args.legacy_notes)
    for flag in ("--use-megatron-fsdp", "--init-model-with-meta-device", "--use-nccl-ub", "--fsdp-double-buffer"):
        assert f"note: {flag} " in notes, flag


# Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh, every flag as it passes them, with
# the sizes shrunk to 4 CPU processes (its PP=4 x EP=8 becomes PP=2 x EP=2, so data parallel 2); the
# Llama-2 tokenizer and data files become --mock-data with the null tokenizer.
MIXTRAL = ("--use-mcore-models --disable-bias-linear --init-method-std 0.01 --attention-dropout 0.0 "
           "--hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu "
           "--untie-embeddings-and-output-weights --group-query-attention --no-masked-softmax-fusion "
           "--no-position-embedding --rotary-base 1000000 "
           "--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
           "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce "
           "--split 99990,8,2 --micro-batch-size 1 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 "
           "--bf16 --tensor-model-parallel-size 1 --use-distributed-optimizer --sequence-parallel "
           "--log-interval 1 --save-interval 10000 --no-load-optim --no-load-rng").split()
MIXTRAL_SHRUNK = ["--seq-length", "64", "--max-position-embeddings", "64", "--num-layers", "4", "--hidden-size", "64",
                  "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--num-query-groups", "2",
                  "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1.0e-4", "--train-iters", "8",
                  "--lr-decay-iters", "8", "--lr-warmup-iters", "2", "--pipeline-model-parallel-size", "2",
                  "--expert-model-parallel-size", "2", "--eval-interval", "8", "--eval-iters", "1",
                  "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--device", "cpu",
                  "--num-workers", "0"]


@pytest.mark.slow
def test_megatron_mixtral_example_flags_run_expert_parallel(tmp_path):
    from megatrain.training.logging import parse_train_log_line

    out = tmp_path / "run"
    paths = ["--save", str(out / "ckpt"), "--load", str(out / "ckpt"), "--tensorboard-dir", str(out / "tb"),
             "--data-cache-path", str(out / "cache")]
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--standalone",
                    "pretrain_gpt.py", *MIXTRAL, *MIXTRAL_SHRUNK, *paths], env=cpu_env(),
                   timeout=600)
    log = proc.stdout
    assert "world 4 = pp 2 x dp 2 x cp 1 x tp 1" in log and "experts: ep 2 x edp 1 (alltoall dispatcher)" in log
    lines = [parse_train_log_line(l) for l in log.splitlines() if "] iteration " in l]
    assert [d["iteration"] for d in lines] == list(range(1, 9))
    losses = [d["lm loss"] for d in lines]
    assert losses[-1] < losses[0] - 0.25, losses
    balancing = [d["load_balancing_loss"] for d in lines]
    assert all(0.5 < v < 4.0 for v in balancing), balancing  # about 1 when balanced (Megatron's normalisation)
    assert "validation loss at iteration 8" in log
    assert (out / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"


def test_the_repository_mixtral_example_passes_megatrons_flags():
    """examples/mixtral/train_mixtral_8x7b_distributed.sh carries Megatron's flag set unchanged (the one
    the run above trains with) and parses as the 32-GPU layout it names."""
    import re

    from megatrain.training.arguments import parse_args

    script = (REPO / "examples" / "mixtral" / "train_mixtral_8x7b_distributed.sh").read_text()
    body = script[script.index("MODEL_ARGS=("):script.index("if [ -n")]
    words = [w for line in body.splitlines() if not line.strip().endswith("=(") and line.strip() != ")"
             for w in line.split() if w != "\\"]
    values = {"$PP": "4", "$EP": "8", "${TOKENIZER_MODEL}": "tok.model", "$DATA_PATH": "data/x_text_document",
              "$CHECKPOINT_PATH": "ckpt", '"${CHECKPOINT_PATH}/tensorboard"': "ckpt/tensorboard"}
    flags = [values.get(w, w) for w in words]
    assert not [w for w in flags if "$" in w], flags
    for i, flag in enumerate(MIXTRAL):
        if flag.startswith("--"):
            assert flag in flags, flag
            nxt = MIXTRAL[i + 1] if i + 1 < len(MIXTRAL) else None
            if nxt is not None and not nxt.startswith("--"):
                assert flags[flags.index(flag) + 1] == nxt, flag
    assert re.search(r"torchrun \$\{DISTRIBUTED_ARGS\[@\]\} pretrain_gpt.py", script)
    env = {"WORLD_SIZE": "32"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        args = parse_args(flags)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert args.num_experts == 8 and args.moe_router_topk == 2 and args.moe_grouped_gemm
    assert args.expert_model_parallel_size == 8 and args.pipeline_model_parallel_size == 4


# Megatron-LM's examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh: its PRETRAIN_ARGS and Megatron-FSDP
# arguments as it passes them (TP=1, EP becomes 1: one CPU process), the sizes shrunk (61 layers of 7168 with
# 256 experts become 3 of 64 with 8; the first dense, as its [0]*3+[1]*58), its Hugging Face tokenizer and data
# files --mock-data with the null tokenizer, wandb off.
DEEPSEEK_V3 = ("--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --expert-model-parallel-size 1 "
               "--expert-tensor-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer "
               "--overlap-grad-reduce --overlap-param-gather --use-mcore-models --sequence-parallel --use-flash-attn "
               "--disable-bias-linear --micro-batch-size 2 --global-batch-size 4 --train-samples 24 "
               "--exit-duration-in-mins 220 --no-check-for-nan-in-loss-and-grad --manual-gc --manual-gc-interval 10 "
               "--recompute-granularity selective --recompute-modules mlp moe mla_up_proj layernorm "
               "--transformer-impl transformer_engine --seq-length 32 --split 99,1,0 --no-mmap-bin-files "
               "--no-create-attention-mask-in-dataloader --num-workers 1 --num-layers 3 --hidden-size 64 "
               "--ffn-hidden-size 96 --num-attention-heads 4 --kv-channels 16 --max-position-embeddings 32 "
               "--position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 32 "
               "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights "
               "--multi-latent-attention --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 "
               "--weight-decay 0.1 --qk-layernorm --lr-decay-samples 20 --lr-warmup-samples 4 --lr-warmup-init 3.9e-7 "
               "--lr 3e-3 --min-lr 3.9e-5 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --num-experts 8 "
               "--moe-layer-freq [0]*1+[1]*2 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32 "
               "--moe-router-load-balancing-type seq_aux_loss --moe-router-topk 2 --moe-token-dispatcher-type flex "
               "--moe-flex-dispatcher-backend hybridep --moe-router-pre-softmax --moe-grouped-gemm "
               "--moe-aux-loss-coeff 1e-4 --moe-router-group-topk 2 --moe-router-num-groups 4 "
               "--moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid "
               "--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 "
               "--moe-permute-fusion --q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
               "--v-head-dim 16 --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1 "
               "--mtp-loss-scaling-factor 0.1 --eval-iters 2 --eval-interval 3 --auto-detect-ckpt-format "
               "--save-interval 3 --dist-ckpt-strictness log_all --init-method-std 0.02 --log-timers-to-tensorboard "
               "--log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm "
               "--log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level 40 --bf16 "
               "--enable-experimental "
               "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
               "--no-gradient-accumulation-fusion --use-distributed-optimizer --calculate-per-token-loss "
               "--init-model-with-meta-device --ckpt-format fsdp_dtensor --fsdp-double-buffer --use-nccl-ub "
               "--megatron-fsdp-grad-comm-dtype bf16 --megatron-fsdp-main-grads-dtype bf16 "
               "--mock-data --tokenizer-type NullTokenizer --vocab-size 500 --device cpu").split()


@pytest.mark.slow
def test_megatron_deepseek_v3_fsdp_example_flags_run_with_multi_token_prediction(tmp_path):
    from megatrain.training.logging import parse_train_log_line

    out = tmp_path / "run"
    paths = ["--save", str(out / "ckpt"), "--load", str(out / "ckpt"), "--tensorboard-dir", str(out / "tb"),
             "--data-cache-path", str(out / "cache")]
    proc = run_cmd([sys.executable, "pretrain_gpt.py", *DEEPSEEK_V3, *paths], env=cpu_env(), timeout=600)
    log = proc.stdout + proc.stderr
    lines = [parse_train_log_line(l) for l in proc.stdout.splitlines() if "] iteration " in l]
    assert [d["iteration"] for d in lines] == list(range(1, 7))
    assert all(0.0 < d["mtp_1 loss"] < 10.0 for d in lines), lines  # the depth's own loss, beside lm loss
    assert "seq_load_balancing_loss" in lines[0] and "params norm" in lines[0] and "num zeros" in lines[0]
    for note in ("--moe-token-dispatcher-type flex", "--enable-experimental", "--recompute-modules layernorm"):
        assert f"note: {note}" in log, note
    assert "validation loss at iteration 6" in proc.stdout
    assert (out / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
