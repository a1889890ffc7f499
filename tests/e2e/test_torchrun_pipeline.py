"""`torchrun --nproc_per_node 8 pretrain_gpt.py` with TP=4 x PP=2 logs the same losses as one process.

The 8-process layout of the Megatron guides (tensor parallel inside a node, two pipeline stages)
on CPU with gloo, --mock-data and a tiny model (hidden 64, 4 heads, 4 layers, tied embeddings):
the lm loss and grad norm of every logged iteration and the validation loss must agree with one
process within 1e-5 relative error (grad norm 1e-3). Also checks that a layer count that does not
divide into the stages is refused with a message naming the flags.
"""

from __future__ import annotations

import sys

import pytest

from megatrain.training.logging import parse_train_log_line
from tests.e2e.conftest import run_cmd
from tests.e2e.conftest import cpu_env as _env
from tests.e2e.conftest import losses_and_validation as _losses

ARGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--train-iters", "4",
        "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500",
        "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "4", "--device", "cpu"]


@pytest.mark.slow
@pytest.mark.long
def test_torchrun_tp4_pp2_matches_one_process():
    ref_train, ref_valid = _losses(run_cmd([sys.executable, "pretrain_gpt.py", *ARGS], env=_env()).stdout)
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "8", "--standalone",
                    "pretrain_gpt.py", *ARGS, "--tensor-model-parallel-size", "4",
                    "--pipeline-model-parallel-size", "2"], env=_env(), timeout=600)
    assert "world 8 = pp 2 x dp 1 x cp 1 x tp 4" in proc.stdout
    train, valid = _losses(proc.stdout)
    assert len(train) == len(ref_train) == 4 and len(valid) == len(ref_valid) >= 1
    for (loss, norm), (ref_loss, ref_norm) in zip(train, ref_train):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-3)
    assert valid == pytest.approx(ref_valid, rel=1e-5)


def test_layers_that_do_not_divide_are_refused():
    proc = run_cmd([sys.executable, "pretrain_gpt.py", *ARGS, "--num-layers", "5", "--pipeline-model-parallel-size",
                    "2"], env={**_env(), "WORLD_SIZE": "2"}, check=False)
    assert proc.returncode != 0
    assert "--num-layers (5)" in proc.stderr and "--decoder-first-pipeline-num-layers" in proc.stderr


@pytest.mark.slow
@pytest.mark.long
def test_pipeline_checkpoint_resumes_exactly_and_under_another_schedule(tmp_path):
    """PP=2 run stopped after 2 of 4 iterations and resumed (1F1B, then interleaved v=2 with another
    stage split) logs the same losses as the uninterrupted PP=2 run."""
    def launch(*extra: str) -> str:
        return run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                        "pretrain_gpt.py", *ARGS, "--pipeline-model-parallel-size", "2",
                        "--eval-iters", "0", *extra], env=_env(), timeout=600).stdout

    full, _ = _losses(launch())
    save = tmp_path / "ckpt"
    first, _ = _losses(launch("--save", str(save), "--exit-interval", "2"))
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    second, _ = _losses(launch("--load", str(save)))
    assert first + second == full  # bitwise on CPU
    other, _ = _losses(launch("--load", str(save), "--num-virtual-stages-per-pipeline-rank", "2"))
    for (loss, norm), (ref_loss, ref_norm) in zip(other, full[2:]):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-3)


@pytest.mark.slow
def test_pipeline_fp16_overflow_is_agreed_across_stages():
    """fp16 with a huge initial loss scale: both stages skip the same steps, back off the scale in step,
    and the logged losses equal one process's."""
    fp16 = ["--fp16", "--initial-loss-scale", "1e20", "--hysteresis", "1", "--eval-iters", "0"]

    def lines(stdout: str) -> list[dict]:
        return [parse_train_log_line(l) for l in stdout.splitlines() if "] iteration " in l]

    one = lines(run_cmd([sys.executable, "pretrain_gpt.py", *ARGS, *fp16], env=_env()).stdout)
    pp = lines(run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                        "pretrain_gpt.py", *ARGS, *fp16, "--pipeline-model-parallel-size", "2"],
                       env=_env(), timeout=600).stdout)
    assert [d["loss scale"] for d in pp] == [d["loss scale"] for d in one]
    assert sum(d["number of skipped iterations"] for d in one) >= 1
    assert [d["number of skipped iterations"] for d in pp] == [d["number of skipped iterations"] for d in one]
    for a, b in zip(pp, one):
        assert ("lm loss" in a) == ("lm loss" in b)
        if "lm loss" in a:
            assert a["lm loss"] == pytest.approx(b["lm loss"], rel=1e-3)


@pytest.mark.slow
@pytest.mark.long  # ~85 s; fp8 against bf16 in one process stays in the default set (test_fast_path_parity.py)
def test_fp8_under_pipeline_parallelism_trains_like_one_fp8_process():
    """--fp8-format converts each pipeline stage's layers; PP=2 logs the losses of one fp8 process."""
    pytest.importorskip("torchao.float8")
    fp8 = [*ARGS, "--bf16", "--fp8-format", "hybrid"]
    ref_train, _ = _losses(run_cmd([sys.executable, "pretrain_gpt.py", *fp8], env=_env()).stdout)
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                    "pretrain_gpt.py", *fp8, "--pipeline-model-parallel-size", "2"], env=_env())
    assert "(on this rank's pipeline stages)" in proc.stdout
    train, _ = _losses(proc.stdout)
    assert len(train) == len(ref_train) == 4
    for (loss, _), (ref_loss, _) in zip(train, ref_train):
        assert loss == pytest.approx(ref_loss, rel=1e-3)  # bf16 activations: summation order differs


@pytest.mark.slow
def test_pipeline_start_up_counts_the_whole_model_and_notes_print_once():
    """The `training: N parameters` line under PP=2 counts both stages (the tied embedding once), as one
    process does; a compatibility flag's note is printed once, by rank 0, not by every rank."""
    import re

    short = [*ARGS, "--train-iters", "1", "--eval-iters", "0", "--use-flash-attn"]

    def count(stdout: str) -> int:
        return int(re.search(r" training: ([\d,]+) parameters", stdout).group(1).replace(",", ""))

    one = run_cmd([sys.executable, "pretrain_gpt.py", *short], env=_env()).stdout
    pp = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                  "pretrain_gpt.py", *short, "--pipeline-model-parallel-size", "2"],
                 env=_env(), timeout=600).stdout
    assert count(pp) == count(one)
    assert pp.count("note: --use-flash-attn") == 1
