"""pretrain_t5.py end to end: Megatron's own T5 example script's flags (examples/t5/
train_t5_220m_distributed.sh), only the sizes shrunk, under TP=2 on two gloo processes with bf16, on
sentence-level WordPiece data with sentinels (--vocab-extra-ids); a falling lm loss, validation lines
and TensorBoard scalars; a checkpoint that resumes exactly; a bad flag refused in one line."""

from __future__ import annotations

import re
import sys

import pytest

from tests.e2e.bert_corpus import write_corpus
from tests.e2e.conftest import REPO, cpu_env, run_cmd

EXAMPLE = REPO / "examples" / "t5" / "train_t5_220m_distributed.sh"


def example_flags() -> list[str]:
    """The example's flags as it passes them (its T5_ARGS, DATA_ARGS and OUTPUT_ARGS strings and the
    launch line), the variables left as placeholders."""
    text = EXAMPLE.read_text(encoding="utf-8")
    flags: list[str] = []
    for name in ("T5_ARGS", "DATA_ARGS", "OUTPUT_ARGS"):
        flags += re.search(rf'{name}="(.*?)"', text, re.S).group(1).replace("\\", " ").split()
    launch = text[text.rindex("pretrain_t5.py"):].split("\n", 1)[1]
    flags += [f for f in launch.replace("\\", " ").split() if not f.startswith("$") or f.endswith("_PATH")]
    return [f for f in flags if f not in ("$T5_ARGS", "$DATA_ARGS", "$OUTPUT_ARGS")]


# Only the sizes shrink (later flags win over the example's); the corpus is lower-cased WordPiece.
SHRUNK = ["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
          "4", "--kv-channels", "16", "--ffn-hidden-size", "128", "--encoder-seq-length", "64",
          "--decoder-seq-length", "32", "--max-position-embeddings", "64", "--micro-batch-size", "4",
          "--global-batch-size", "16", "--train-iters", "15", "--lr-decay-iters", "15", "--lr", "5e-3",
          "--log-interval", "5", "--eval-interval", "10", "--eval-iters", "2", "--save-interval", "10",
          "--split", "90,8,2", "--tensor-model-parallel-size", "2", "--tokenizer-type", "BertWordPieceLowerCase",
          "--device", "cpu", "--num-workers", "0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("t5_corpus"))


def _launch(nproc: int, flags: list[str], timeout: int = 600) -> str:
    launch = ([sys.executable] if nproc == 1 else
              [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--standalone"])
    return run_cmd([*launch, "pretrain_t5.py", *flags], env=cpu_env(), timeout=timeout).stdout


def _parse(stdout: str):
    from megatrain.training.logging import parse_train_log_line, parse_validation_line

    train = [parse_train_log_line(x) for x in stdout.splitlines() if "] iteration " in x]
    valid = [parse_validation_line(x) for x in stdout.splitlines() if "validation loss at" in x]
    return train, valid


@pytest.fixture(scope="module")
def tp2_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("t5_run")
    paths = {"$CHECKPOINT_PATH": str(out / "ckpt"), "${TENSORBOARD_DIR}": str(out / "tb"),
             "$VOCAB_FILE": corpus["vocab"], "$DATA_PATH": corpus["data_path"], "$TP": "2"}
    flags = [paths.get(f, f) for f in example_flags()] + SHRUNK + ["--data-cache-path", str(out / "cache")]
    return flags, _launch(2, flags), out


def test_megatron_example_runs_under_tp2_with_a_falling_loss(tp2_run):
    flags, stdout, out = tp2_run
    assert "--bf16" in flags and "--vocab-extra-ids" in flags and "--transformer-impl" in flags
    assert not any(f.startswith("$") for f in flags), flags
    train, valid = _parse(stdout)
    assert [d["iteration"] for d in train] == [5, 10, 15]
    assert train[-1]["lm loss"] < 0.8 * train[0]["lm loss"], [d["lm loss"] for d in train]
    assert len(valid) >= 2 and valid[-1]["lm loss value"] < valid[0]["lm loss value"] * 1.05
    assert "test set" in stdout and "lm loss PPL" in stdout


def test_tensorboard_has_the_losses(tp2_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, _, out = tp2_run
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "lm loss" in tags and any("lm loss" in t and "validation" in t for t in tags), sorted(tags)


# ~18 s (as BERT's in test_pretrain_bert.py): a TP=2 checkpoint of the real trainer resuming exactly is
# tests/distributed/test_t5_layouts.py's tp2_saves_after_2 -> resume_dp2_zero1, and --load continuing a T5 run
# exactly test_t5_finetune.py's
@pytest.mark.long
def test_the_checkpoint_resumes_exactly(tp2_run, tmp_path):
    from megatrain import checkpoint as checkpointing

    flags, stdout, out = tp2_run
    meta = checkpointing.read_meta(checkpointing.find_checkpoint(str(out / "ckpt"), 10))
    assert meta["family"] == "t5" and meta["model_config"]["decoder_num_layers"] == 2
    want = {d["iteration"]: d for d in _parse(stdout)[0]}
    resumed = [*flags, "--load", str(out / "ckpt"), "--ckpt-step", "10", "--save", str(tmp_path / "again")]
    again, _ = _parse(_launch(2, resumed))
    assert [d["iteration"] for d in again] == [15]
    for d in again:
        assert d["lm loss"] == pytest.approx(want[d["iteration"]]["lm loss"], rel=1e-5)


def test_bad_input_is_one_line(corpus):
    args = ["--encoder-num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--encoder-seq-length",
            "32", "--decoder-seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
            "--vocab-file", corpus["vocab"], "--data-path", corpus["data_path"], "--device", "cpu"]
    proc = run_cmd([sys.executable, "pretrain_t5.py", *args], env=cpu_env(), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--vocab-extra-ids 0: T5's span corruption" in proc.stderr, proc.stderr[-2000:]
