"""`torchrun pretrain_gpt.py --context-parallel-size C` logs the same losses as one process.

LLaMA-style model (RoPE, GQA, SwiGLU, RMSNorm, untied) on CPU with gloo: context parallel alone
(C=4), with data parallel (DDP), with tensor + sequence parallel, with ZeRO-3 and with pipeline
parallel; every logged
iteration's loss and grad norm and every validation loss must agree within 1e-5 (grad norms 1e-3,
they print three decimals). A checkpoint saved under C=2 x DP=2 resumes in one process exactly.
"""

from __future__ import annotations

import sys

import pytest

from tests.e2e.conftest import assert_runs_close
from tests.e2e.conftest import cpu_env, losses_and_validation, run_cmd

ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--train-iters", "4",
        "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500",
        "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "4", "--device", "cpu",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
        "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def _torchrun(n: int, *extra: str) -> str:
    return run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--standalone",
                    "pretrain_gpt.py", *ARGS, *extra], env=cpu_env(), timeout=600).stdout


_assert_close = assert_runs_close


@pytest.fixture(scope="module")
def one_process():
    return losses_and_validation(run_cmd([sys.executable, "pretrain_gpt.py", *ARGS], env=cpu_env()).stdout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    pytest.param(["--context-parallel-size", "4"], marks=pytest.mark.long),
    # x DP=2 (DDP over the data x context ranks; cp2_dp2_zero3 runs the same ranks in every run)
    pytest.param(["--context-parallel-size", "2"], marks=pytest.mark.long),
    ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--context-parallel-size", "2", "--zero-stage", "3"],
    pytest.param(["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"], marks=pytest.mark.long),
], ids=["cp4", "cp2_dp2", "cp2_tp2_sp", "cp2_dp2_zero3", "cp2_pp2"])
def test_context_parallel_layouts_match_one_process(one_process, layout):
    out = _torchrun(4, *layout)
    cp = layout[1]
    assert f"x cp {cp} x" in out
    _assert_close(losses_and_validation(out), one_process)


@pytest.mark.slow
@pytest.mark.long
def test_bf16_context_parallel_with_the_gradient_accumulation_fusion_trains_like_one_process():
    """--bf16 turns the fusion on (staged float32 gradients added inside the matmuls, then DDP over
    the data x context ranks): CP=2 x DP=2 follows one process within bf16 tolerance."""
    one = run_cmd([sys.executable, "pretrain_gpt.py", *ARGS, "--bf16"], env=cpu_env()).stdout
    four = _torchrun(4, "--bf16", "--context-parallel-size", "2")
    for out in (one, four):
        assert "gradient-accumulation fusion: 8 weights" in out  # 4 linear layers x 2 layers (no chunked loss on CPU)
    (train, valid), (ref_train, ref_valid) = losses_and_validation(four), losses_and_validation(one)
    assert len(train) == len(ref_train) == 4
    for (loss, norm), (ref_loss, ref_norm) in zip(train, ref_train):
        assert loss == pytest.approx(ref_loss, rel=1e-2) and norm == pytest.approx(ref_norm, rel=5e-2)
    assert valid == pytest.approx(ref_valid, rel=1e-2)


@pytest.mark.slow
@pytest.mark.long
def test_context_parallel_checkpoint_resumes_in_one_process(one_process, tmp_path):
    save = tmp_path / "ckpt"
    _torchrun(4, "--context-parallel-size", "2", "--save", str(save), "--exit-interval", "2")
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    rest = losses_and_validation(run_cmd([sys.executable, "pretrain_gpt.py", *ARGS, "--load", str(save)],
                                         env=cpu_env()).stdout)
    ref_train, ref_valid = one_process
    _assert_close(rest, (ref_train[2:], ref_valid))
