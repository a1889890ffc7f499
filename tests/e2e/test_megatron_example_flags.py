"""Megatron-LM's own example scripts' flags run here: the Llama-3 8B fp8 example
(examples/llama/train_llama3_8b_h100_fp8.sh) with only the sizes shrunk to run on a CPU."""

from __future__ import annotations

import sys

import pytest

from tests.e2e.conftest import cpu_env, run_cmd

SHRUNK = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
          "--max-position-embeddings", "64", "--ffn-hidden-size", "128", "--num-query-groups", "2",
          "--kv-channels", "16", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "48",
          "--lr-decay-samples", "40", "--lr-warmup-samples", "8", "--vocab-size", "1000", "--device", "cpu",
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
    for note in ("--attention-backend", "--fp8-amax-history-len 1024", "--fp8-param-gather", "--ckpt-format"):
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
