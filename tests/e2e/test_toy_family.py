"""The model-family seam, end to end: a test-only family (``tests/toy_family``: a bidirectional encoder
with two classification losses, registered by its own folder) trains, validates, checkpoints,
resumes exactly and runs under DP=2, TP=2 (with sequence parallelism) and PP=2 through the real
trainer, pipeline and checkpoint code, which know nothing about it."""

from __future__ import annotations

import sys

import pytest

from tests.e2e.conftest import cpu_env, run_cmd

SCRIPT = "tests/toy_family/pretrain_toy.py"
NAMES = ("cls loss", "parity loss")
ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--lr", "3e-3",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--log-interval", "1",
        "--eval-iters", "1", "--device", "cpu"]


def _run(*extra: str, nproc: int = 1) -> str:
    launch = ([sys.executable] if nproc == 1 else
              [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--standalone"])
    return run_cmd([*launch, SCRIPT, *ARGS, *extra], env=cpu_env()).stdout


def _losses(stdout: str) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Every logged iteration's losses and grad norm, and every validation line's losses."""
    from megatrain.training.logging import parse_train_log_line, parse_validation_line

    train = [parse_train_log_line(line) for line in stdout.splitlines() if "] iteration " in line]
    valid = [parse_validation_line(line) for line in stdout.splitlines() if "validation loss at" in line]
    return ([{k: d[k] for k in (*NAMES, "grad norm", "iteration")} for d in train],
            [{k: d[f"{k} value"] for k in NAMES} for d in valid])


def _assert_close(got, want, start: int = 0) -> None:
    (train, valid), (ref_train, ref_valid) = got, want
    ref_train = [r for r in ref_train if r["iteration"] > start]
    assert [r["iteration"] for r in train] == [r["iteration"] for r in ref_train]
    for a, b in zip(train, ref_train):
        for name in NAMES:
            assert a[name] == pytest.approx(b[name], rel=1e-5), (a, b)
        assert a["grad norm"] == pytest.approx(b["grad norm"], rel=1e-3)
    assert len(valid) == len(ref_valid) >= 1
    for a, b in zip(valid, ref_valid):
        assert a == pytest.approx(b, rel=1e-5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    save = tmp_path_factory.mktemp("toy") / "ckpt"
    out = _run("--train-iters", "8", "--eval-interval", "4", "--save", str(save), "--save-interval", "4")
    return _losses(out), save, out


def test_the_toy_family_trains_validates_and_logs_every_loss(reference):
    (train, valid), _, out = reference
    assert len(train) == 8 and len(valid) == 4  # iterations 4 and 8, then the final validation and test
    assert " cls loss: " in out and " parity loss: " in out and "parity loss PPL" in out
    longer = _losses(_run("--train-iters", "40", "--log-interval", "10", "--eval-interval", "40"))[0]
    assert longer[-1]["cls loss"] < 0.8 * longer[0]["cls loss"]
    assert longer[-1]["parity loss"] < 0.6 * longer[0]["parity loss"]


def test_the_checkpoint_names_the_family_and_its_config_and_resumes_exactly(reference):
    from megatrain.models.registry import get_family
    from megatrain import checkpoint as checkpointing
    from tests.toy_family import TOY
    from tests.toy_family.model import ToyEncoderConfig

    (train, valid), save, _ = reference
    ckpt = checkpointing.find_checkpoint(str(save), 8)
    meta = checkpointing.read_meta(ckpt)
    family, config = get_family(checkpointing.checkpoint_family(meta)), checkpointing.checkpoint_model_config(ckpt, meta)
    assert family is TOY and meta["family"] == "toy"
    assert config == ToyEncoderConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128,
                                      max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    resumed = _losses(_run("--train-iters", "8", "--eval-interval", "4", "--load", str(save), "--ckpt-step", "4"))
    _assert_close(resumed, (train, valid[1:]), start=4)
    # A GPT run refuses the toy family's checkpoint in one line.
    proc = run_cmd([sys.executable, "pretrain_gpt.py", *ARGS, "--train-iters", "8", "--load", str(save)],
                   env=cpu_env(), check=False)
    assert proc.returncode != 0 and "family" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("layout", [pytest.param(["--use-distributed-optimizer"], marks=pytest.mark.long),
                                    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                    pytest.param(["--pipeline-model-parallel-size", "2"], marks=pytest.mark.long)],
                         ids=["dp2", "tp2_sp", "pp2"])
def test_the_toy_family_runs_in_parallel_layouts_like_one_process(reference, layout):
    (train, valid), _, _ = reference
    got = _losses(_run("--train-iters", "8", "--eval-interval", "4", *layout, nproc=2))
    _assert_close(got, (train, valid))
