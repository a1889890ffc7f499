"""finetune.py on a T5 checkpoint: input/target jsonl with teacher forcing; the loss of a tiny model on a
tiny copy task clearly falls, validation lines every --eval-interval, a resume continues the run exactly, and
bad input is one line naming the flag or file."""

from __future__ import annotations

import json
import random
import sys

import pytest

from megatrain.models.t5 import T5Model
from megatrain.training.finetune_classify import main_any
from tests.e2e.conftest import cpu_env, run_cmd
from tests.unit.t5_tiny import config, save, write_vocab

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "big", "red", "hello", "world"]
FLAGS = ["--micro-batch-size", "16", "--global-batch-size", "16", "--lr", "5e-3", "--lr-warmup-iters", "10",
         "--log-interval", "30", "--eval-interval", "60", "--eval-iters", "2", "--encoder-seq-length", "16",
         "--decoder-seq-length", "8", "--device", "cpu", "--num-workers", "0", "--hidden-dropout", "0",
         "--attention-dropout", "0"]


def _copy_task(path, n: int, seed: int) -> str:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
            f.write(json.dumps({"input": text, "target": text}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5_finetune")
    vocab = write_vocab(root / "vocab.txt")
    pre = save(T5Model(config("untied_swiglu")), root / "pre", vocab)  # a freshly initialised T5 "pre-training"
    return {"root": root, "pre": str(pre), "train": _copy_task(root / "train.jsonl", 200, 0),
            "valid": _copy_task(root / "valid.jsonl", 20, 1)}


def _losses(stdout: str):
    from megatrain.training.logging import parse_train_log_line, parse_validation_line

    train = [parse_train_log_line(x) for x in stdout.splitlines() if "] iteration " in x]
    valid = [parse_validation_line(x) for x in stdout.splitlines() if "validation loss at iteration" in x]
    return train, valid


@pytest.fixture(scope="module")
def finetuned(task):
    save_dir = task["root"] / "ft"
    argv = [sys.executable, "finetune.py", "--pretrained-checkpoint", task["pre"], "--train-data", task["train"],
            "--valid-data", task["valid"], "--train-iters", "120", "--save", str(save_dir), "--save-interval", "60",
            *FLAGS]
    return save_dir, argv, run_cmd(argv, env=cpu_env(), timeout=300).stdout


def test_the_copy_task_loss_clearly_falls_with_validation(finetuned):
    _, _, stdout = finetuned
    assert "sequence-to-sequence fine-tuning: 200 training and 20 validation examples" in stdout
    train, valid = _losses(stdout)
    assert [d["iteration"] for d in train] == [30, 60, 90, 120]
    assert train[-1]["lm loss"] < 0.5 * train[0]["lm loss"], [d["lm loss"] for d in train]
    assert len(valid) >= 2 and valid[-1]["lm loss value"] < valid[0]["lm loss value"]


def test_load_resumes_the_fine_tuning_run(finetuned, task):
    from megatrain import checkpoint as checkpointing

    save_dir, argv, stdout = finetuned
    meta = checkpointing.read_meta(checkpointing.find_checkpoint(str(save_dir), 60))
    assert meta["family"] == "t5" and meta["seq2seq_finetuning"] == {"input_key": "input", "target_key": "target"}
    resumed = argv + ["--load", str(save_dir), "--ckpt-step", "60", "--save", str(task["root"] / "again")]
    train, _ = _losses(run_cmd(resumed, env=cpu_env(), timeout=300).stdout)
    want = {d["iteration"]: d["lm loss"] for d in _losses(stdout)[0]}
    assert [d["iteration"] for d in train] == [90, 120]  # continued from 60, not started again
    for d in train:
        assert d["lm loss"] == pytest.approx(want[d["iteration"]], rel=1e-5)


def test_bad_input_is_one_line(task, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "the cat", "target": "the cat"}\n{"input": "the dog"}\n', encoding="utf-8")
    base = ["--pretrained-checkpoint", task["pre"], "--train-iters", "20", *FLAGS]
    with pytest.raises(SystemExit) as e:
        main_any([*base, "--train-data", str(bad)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == f"error: --train-data {bad}:2: expected a string 'target' (keys: 'input')"
    with pytest.raises(SystemExit) as e:
        main_any([*base, "--train-data", task["train"], "--data-path", "x"])
    assert "--train-data / --valid-data, not --data-path" in str(e.value.code)
