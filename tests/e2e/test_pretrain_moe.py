"""`pretrain_gpt.py` with a tiny Mixtral-like mixture-of-experts model on one CPU process: the loss
falls, the balancing loss is logged, the start-up report gives total and active parameters, and a
checkpoint resumes with identical losses (the MoE config, a --moe-layer-freq pattern included, read
back from meta.json)."""

from __future__ import annotations

import sys

from megatrain.training.logging import parse_train_log_line
from tests.e2e.conftest import cpu_env, run_cmd

MIXTRAL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
           "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64",
           "--micro-batch-size", "4", "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
           "--num-workers", "0", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
           "--disable-bias-linear", "--untie-embeddings-and-output-weights",
           "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
           "--moe-aux-loss-coeff", "1e-2",
           "--moe-grouped-gemm", "--moe-layer-freq", "([1]*2)",
           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--eval-iters", "0",
           "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "16", "--log-interval", "1", "--seed", "3"]


def _lines(stdout: str) -> list[dict]:
    return [parse_train_log_line(line) for line in stdout.splitlines() if "] iteration " in line]


def test_moe_pretrain_loss_falls_logs_balancing_loss_and_resumes_exactly(tmp_path):
    save = tmp_path / "ckpt"
    full = run_cmd([sys.executable, "pretrain_gpt.py", *MIXTRAL, "--save", str(save), "--save-interval", "8"],
                   env=cpu_env())
    lines = _lines(full.stdout)
    assert [d["iteration"] for d in lines] == list(range(1, 17))
    losses = [d["lm loss"] for d in lines]
    assert losses[-1] < losses[0] - 1.0 and losses[-1] < min(losses[:4]), losses
    balancing = [d["load_balancing_loss"] for d in lines]
    assert all(0.9 < v < 2.0 for v in balancing), balancing  # ~1 when balanced (E * sum f_i P_i)
    memory = next(line for line in full.stdout.splitlines() if "theoretical memory" in line)
    assert " (active " in memory  # the experts' top-k share of the parameters
    assert (save / "iter_0000008" / "meta.json").is_file()

    resumed = run_cmd([sys.executable, "pretrain_gpt.py", *MIXTRAL, "--load", str(save), "--ckpt-step", "8"],
                      env=cpu_env())
    second = _lines(resumed.stdout)
    assert [d["iteration"] for d in second] == list(range(9, 17))
    for a, b in zip(lines[8:], second):
        assert (a["lm loss"], a["load_balancing_loss"], a["grad norm"]) == \
            (b["lm loss"], b["load_balancing_loss"], b["grad norm"]), (a, b)


def test_bf16_moe_layer_recompute_with_shared_experts_runs_on_one_process():
    """Recomputing MoE layers whose shared experts are linear layers: on one process in bf16 the
    gradient-accumulation fusion used to be on, its recomputed forward saw no staged gradient and the
    checkpoint refused the backward (a different number of saved tensors). Recomputing linear layers now
    turns the fusion off (`--recompute-modules moe` is the same setting: tests/unit/test_recompute.py)."""
    run = [sys.executable, "pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
           "4", "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--num-experts", "4", "--moe-router-topk", "2",
           "--moe-shared-expert-intermediate-size", "32", "--moe-ffn-hidden-size", "32", "--disable-bias-linear",
           "--train-iters", "3", "--lr", "1e-2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
           "64", "--log-interval", "1", "--eval-iters", "0", "--device", "cpu", "--bf16", "--hidden-dropout", "0",
           "--attention-dropout", "0"]
    logs = []
    for extra in (["--moe-layer-recompute"], ["--moe-layer-recompute", "--no-gradient-accumulation-fusion"]):
        out = run_cmd([*run, *extra], env=cpu_env()).stdout
        logs.append([parse_train_log_line(line)["lm loss"] for line in out.splitlines() if "] iteration " in line])
    assert len(logs[0]) == 3 and logs[0] == logs[1]
