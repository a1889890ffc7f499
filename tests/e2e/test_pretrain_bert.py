"""pretrain_bert.py end to end: Megatron's own BERT example script's flags (examples/bert/
train_bert_340m_distributed.sh), only the sizes shrunk, under TP=2 x PP=2 on gloo with fp16;
falling lm and sop losses, validation lines and TensorBoard scalars of both; a checkpoint that
resumes exactly and reloads under another layout; the refusals of bad input."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.e2e.bert_corpus import write_corpus
from tests.e2e.conftest import REPO, cpu_env, run_cmd

EXAMPLE = REPO / "examples" / "bert" / "train_bert_340m_distributed.sh"


def example_flags() -> list[str]:
    """The example's flags as it passes them (its bash arrays), the paths left as placeholders."""
    text = EXAMPLE.read_text(encoding="utf-8")
    flags: list[str] = []
    for name in ("BERT_MODEL_ARGS", "TRAINING_ARGS", "MODEL_PARALLEL_ARGS", "DATA_ARGS", "EVAL_AND_LOGGING_ARGS"):
        body = re.search(rf"{name}=\((.*?)\)", text, re.S).group(1)
        for line in body.splitlines():
            flags += line.split("#")[0].split()
    return flags


# Only the sizes shrink: later flags win over the example's.
SHRUNK = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
          "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
          "--train-iters", "30", "--lr-decay-iters", "30", "--lr", "5e-3", "--log-interval", "5",
          "--eval-interval", "10", "--eval-iters", "2", "--save-interval", "15", "--split", "90,8,2",
          "--device", "cpu", "--num-workers", "0", "--initial-loss-scale", "4096"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("bert_corpus"))


def _substitute(flags: list[str], paths: dict[str, str]) -> list[str]:
    return [paths.get(f, f) for f in flags]


def _launch(nproc: int, flags: list[str], timeout: int = 600) -> str:
    launch = ([sys.executable] if nproc == 1 else
              [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--standalone"])
    return run_cmd([*launch, "pretrain_bert.py", *flags], env=cpu_env(), timeout=timeout).stdout


def _parse(stdout: str):
    from megatrain.training.logging import parse_train_log_line, parse_validation_line

    train = [parse_train_log_line(x) for x in stdout.splitlines() if "] iteration " in x]
    valid = [parse_validation_line(x) for x in stdout.splitlines() if "validation loss at" in x]
    return train, valid


@pytest.fixture(scope="module")
def tp2_pp2_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("bert_run")
    paths = {"$CHECKPOINT_PATH": str(out / "ckpt"), "$TENSORBOARD_LOGS_PATH": str(out / "tb"),
             "$VOCAB_FILE": corpus["vocab"], "$DATA_PATH": corpus["data_path"], "$TP": "2", "$PP": "2"}
    flags = _substitute(example_flags(), paths) + SHRUNK + ["--data-cache-path", str(out / "cache")]
    return flags, _launch(4, flags), out


def test_megatron_example_runs_under_tp2_pp2_with_falling_losses(tp2_pp2_run):
    flags, stdout, out = tp2_pp2_run
    assert "--fp16" in flags and "--attention-backend" in flags
    train, valid = _parse(stdout)
    assert [d["iteration"] for d in train] == [5, 10, 15, 20, 25, 30]
    assert all("lm loss" in d and "sop loss" in d for d in train)
    assert train[-1]["lm loss"] < 0.8 * train[0]["lm loss"], [d["lm loss"] for d in train]
    assert train[-1]["sop loss"] < train[0]["sop loss"] + 0.05
    assert len(valid) >= 3 and all("lm loss value" in v and "sop loss value" in v for v in valid)
    assert valid[2]["lm loss value"] < 0.8 * valid[0]["lm loss value"] or valid[2]["lm loss value"] < 4.0
    assert "sop loss PPL" in stdout


def test_tensorboard_has_both_losses(tp2_pp2_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, _, out = tp2_pp2_run
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for name in ("lm loss", "sop loss"):
        assert name in tags and any(name in t and "validation" in t for t in tags), sorted(tags)


@pytest.mark.long
def test_resume_is_exact_and_another_layout_loads_the_checkpoint(tp2_pp2_run, tmp_path):
    from megatrain import checkpoint as checkpointing

    flags, stdout, out = tp2_pp2_run
    meta = checkpointing.read_meta(checkpointing.find_checkpoint(str(out / "ckpt"), 15))
    assert meta["family"] == "bert"
    train, _ = _parse(stdout)
    # Resume the same layout from iteration 15 into a fresh save directory: iterations 20-30 again.
    resumed_flags = [*flags, "--load", str(out / "ckpt"), "--ckpt-step", "15", "--save", str(tmp_path / "again")]
    again, _ = _parse(_launch(4, resumed_flags))
    want = {d["iteration"]: d for d in train}
    assert [d["iteration"] for d in again] == [20, 25, 30]
    for d in again:
        assert d["lm loss"] == pytest.approx(want[d["iteration"]]["lm loss"], rel=1e-5)
        assert d["sop loss"] == pytest.approx(want[d["iteration"]]["sop loss"], rel=1e-5)
    # One process (no TP/PP) continues from the same checkpoint; the losses go on from where they were.
    single = [*flags, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
              "--load", str(out / "ckpt"), "--ckpt-step", "15", "--save", str(tmp_path / "single"),
              "--exit-interval", "20"]
    one, _ = _parse(_launch(1, single))
    assert [d["iteration"] for d in one] == [20]
    assert one[0]["lm loss"] == pytest.approx(want[20]["lm loss"], rel=0.05)


def _bert_args(corpus, *extra):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
            "--vocab-file", corpus["vocab"], "--data-path", corpus["data_path"], "--device", "cpu", *extra]


@pytest.mark.parametrize("extra, message", [
    (["--seq-length", "64"], "--seq-length (64) is larger than --max-position-embeddings (32)"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", "x"], "BertWordPiece"),
])
def test_bad_input_is_one_line(corpus, extra, message):
    proc = run_cmd([sys.executable, "pretrain_bert.py", *_bert_args(corpus, *extra)], env=cpu_env(), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert message in proc.stderr + proc.stdout, proc.stderr[-2000:]


def test_document_level_data_is_refused_naming_the_file(corpus, tmp_path):
    prefix = tmp_path / "docs"
    run_cmd([sys.executable, "tools/preprocess_data.py", "--input", corpus["corpus"], "--output-prefix", str(prefix),
             "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", corpus["vocab"], "--workers", "1"])
    args = _bert_args(corpus)
    args[args.index("--data-path") + 1] = f"{prefix}_text_document"
    proc = run_cmd([sys.executable, "pretrain_bert.py", *args], env=cpu_env(), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "split-sentences" in proc.stderr + proc.stdout and "docs_text_document" in proc.stderr + proc.stdout
