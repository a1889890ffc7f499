"""finetune.py end to end on CPU: a randomly initialised tiny BERT checkpoint (saved by the trainer's
checkpoint code from pretrain_bert.py's command line) fine-tuned for sentiment classification on a
tiny synthetic lexicon reaches a validation accuracy far above chance; the label mapping is saved
with the checkpoint and a resume keeps it; fill-mask runs on the pre-trained checkpoint; given a GPT
checkpoint, finetune.py runs finetune_gpt.py's supervised fine-tuning. Plus the example encoding
([CLS] a [SEP] b [SEP], token types, truncation of the longer segment) and the label rules."""

from __future__ import annotations

import json
import random
import re
import sys

import numpy as np
import pytest

from tests.e2e.conftest import cpu_env, run_cmd

POSITIVE = ["good", "great", "happy", "love", "excellent", "fun"]
NEGATIVE = ["bad", "awful", "sad", "hate", "terrible", "boring"]
FILLER = ["the", "movie", "was", "a", "day", "it", "this", "really", "so", "very", "film", "story", "i", "we",
          "and", "cat", "sat", "on", "mat"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--make-vocab-size-divisible-by", "8"]
VALIDATION = re.compile(r" validation at (.*?) \| classification loss: ([0-9.E+-]+) \| accuracy: ([0-9.]+) \|")


def _examples(path, n: int, rng: random.Random) -> None:
    """Sentences of filler words with one sentiment word; half with a second (filler) segment."""
    with open(path, "w") as f:
        for _ in range(n):
            words = [rng.choice(FILLER) for _ in range(rng.randint(3, 8))]
            positive = rng.random() < 0.5
            words.insert(rng.randrange(len(words) + 1), rng.choice(POSITIVE if positive else NEGATIVE))
            example = {"text": " ".join(words), "label": "positive" if positive else "negative"}
            if rng.random() < 0.5:
                example["text_pair"] = " ".join(rng.choice(FILLER) for _ in range(rng.randint(1, 5)))
            f.write(json.dumps(example) + "\n")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """vocab.txt, train/valid jsonl, and a randomly initialised BERT checkpoint ``pre``."""
    from megatrain import checkpoint as checkpointing
    from megatrain.data.tokenizers import build_tokenizer
    from megatrain.models.registry import get_family
    from megatrain.training.builders import padded_vocab_size
    from megatrain.training.main import parse_family_args

    root = tmp_path_factory.mktemp("bert_finetune")
    (root / "vocab.txt").write_text("\n".join(SPECIAL + POSITIVE + NEGATIVE + FILLER) + "\n")
    rng = random.Random(0)
    _examples(root / "train.jsonl", 400, rng)
    _examples(root / "valid.jsonl", 100, rng)
    # pretrain_bert.py's command line and the trainer's model and checkpoint code, without training.
    args = parse_family_args("bert", [*BERT, "--micro-batch-size", "8", "--train-iters", "1", "--lr", "1e-4",
                                      "--data-path", "unused", "--vocab-file", str(root / "vocab.txt")])
    family = get_family("bert")
    config = family.config_from_args(args, padded_vocab_size(build_tokenizer(args).vocab_size,
                                                             args.make_vocab_size_divisible_by, 1))
    model = family.build_model(config)
    model.init_weights(args.seed)
    checkpointing.save_checkpoint(str(root / "pre"), checkpointing.TrainState(), model, None, {}, args, config)
    return root


def _validations(stdout: str) -> list[tuple[str, float, float]]:
    return [(where, float(loss), float(acc)) for where, loss, acc in VALIDATION.findall(stdout)]


def test_classification_learns_and_resumes(task):
    common = ["--train-data", str(task / "train.jsonl"), "--valid-data", str(task / "valid.jsonl"),
              "--seq-length", "24", "--micro-batch-size", "16", "--lr", "1e-3", "--log-interval", "25",
              "--num-workers", "0"]
    proc = run_cmd([sys.executable, "finetune.py", "--pretrained-checkpoint", str(task / "pre"), *common,
                    "--train-iters", "120", "--lr-warmup-iters", "10", "--eval-interval", "60",
                    "--save", str(task / "ft")], env=cpu_env())
    out = proc.stdout
    assert "finetune: iteration and optimizer reset" in out
    assert "classification: 2 classes: 0 = 'negative', 1 = 'positive'" in out
    assert re.search(r"\| classification loss: [0-9.E+-]+ \|", out)  # the training log line
    valid = _validations(out)
    assert [w for w, _, _ in valid] == ["iteration 60", "iteration 120", "iteration 120 on validation set"], valid
    assert valid[-1][2] > 0.8 and valid[-1][1] < 0.5, valid  # chance is 0.5 (two balanced classes)
    meta = json.loads((task / "ft" / "iter_0000120" / "meta.json").read_text())
    assert meta["family"] == "bert"
    assert meta["classification"] == {"num_classes": 2, "labels": ["negative", "positive"]}

    # --load holding this task's checkpoint resumes it (it wins over --pretrained-checkpoint).
    resumed = run_cmd([sys.executable, "finetune.py", "--load", str(task / "ft"), "--pretrained-checkpoint",
                       str(task / "pre"), *common, "--train-iters", "130", "--lr-warmup-iters", "10",
                       "--use-checkpoint-opt_param-scheduler"], env=cpu_env())
    assert "loaded checkpoint from" in resumed.stdout and "at iteration 120" in resumed.stdout
    assert "finetune:" not in resumed.stdout
    assert _validations(resumed.stdout)[-1][2] > 0.8

    # A label the checkpoint's task does not know is one line naming the file and line.
    bad = task / "bad.jsonl"
    bad.write_text(json.dumps({"text": "good day", "label": "neutral"}) + "\n")
    err = run_cmd([sys.executable, "-m", "megatrain", "finetune-classify", "--pretrained-checkpoint",
                   str(task / "pre"), *common, "--valid-data", str(bad), "--train-iters", "1"], env=cpu_env(),
                  check=False)
    assert err.returncode != 0 and "Traceback" not in err.stderr
    assert "bad.jsonl:1: label 'neutral' is not one of the training labels" in err.stderr


def test_fill_mask_and_generate_on_the_bert_checkpoint(task):
    proc = run_cmd([sys.executable, "-m", "megatrain", "fill-mask", "--load", str(task / "pre"), "--text",
                    "the [MASK] was good", "--top-k", "3", "--json"], env=cpu_env())
    (result,) = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert len(result["masks"]) == 1 and len(result["masks"][0]["predictions"]) == 3
    assert result["tokens"][2] == SPECIAL.index("[MASK]")
    gen = run_cmd([sys.executable, "tools/generate.py", "--load", str(task / "pre"), "--prompt", "the"],
                  env=cpu_env(), check=False)
    assert gen.returncode != 0 and "fill_mask.py" in gen.stderr and "Traceback" not in gen.stderr


def test_finetune_py_runs_gpt_fine_tuning_for_a_gpt_checkpoint(tmp_path):
    gpt = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
           "--max-position-embeddings", "16", "--micro-batch-size", "4", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", "17", "--make-vocab-size-divisible-by", "8", "--num-workers", "0", "--eval-iters", "0"]
    run_cmd([sys.executable, "pretrain_gpt.py", *gpt, "--mock-data", "--train-iters", "1", "--lr", "1e-3",
             "--save", str(tmp_path / "pre")], env=cpu_env())
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": "1 2 3 16", "response": " 3 2 1"}) + "\n" for _ in range(16)))
    proc = run_cmd([sys.executable, "finetune.py", *gpt, "--pretrained-checkpoint", str(tmp_path / "pre"),
                    "--train-data", str(data), "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1"],
                   env=cpu_env())
    assert "finetune: iteration and optimizer reset" in proc.stdout and "| lm loss:" in proc.stdout
    from megatrain.training.finetune_classify import main as classify

    with pytest.raises(SystemExit, match="holds a 'gpt' model; classification fine-tuning needs a BERT checkpoint"):
        classify(["--pretrained-checkpoint", str(tmp_path / "pre"), "--train-data", str(data), "--train-iters", "1",
                  "--lr", "1e-3"])


# ---- the encoding and the labels (in process) -----------------------------------------------------

def test_example_encoding_and_truncation():
    from megatrain.training.finetune_classify import encode_example, truncate_pair

    tokens, types, mask, cut = encode_example([10, 11], [20], 8, cls=2, sep=3, pad=0)
    assert tokens.tolist() == [2, 10, 11, 3, 20, 3, 0, 0] and not cut
    assert types.tolist() == [0, 0, 0, 0, 1, 1, 0, 0] and mask.tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    tokens, types, mask, cut = encode_example([10, 11, 12, 13, 14], None, 5, cls=2, sep=3, pad=0)
    assert tokens.tolist() == [2, 10, 11, 12, 3] and cut and mask.all() and not types.any()
    # The longer segment loses its last tokens first (the second one on a tie).
    assert truncate_pair([1, 2, 3, 4, 5], [6, 7], 5)[:2] == ([1, 2, 3], [6, 7])
    assert truncate_pair([1, 2, 3], [6, 7, 8], 4)[:2] == ([1, 2], [6, 7])
    tokens, types, _, _ = encode_example(list(range(10, 20)), list(range(30, 34)), 10, cls=2, sep=3, pad=0)
    assert tokens.tolist() == [2, 10, 11, 12, 13, 3, 30, 31, 32, 3]
    assert np.array_equal(types, [0] * 6 + [1] * 4)


def test_label_rules():
    from megatrain.training.finetune_classify import Example, label_set

    def ex(*labels):
        return [Example("t", None, label, f"f:{i + 1}") for i, label in enumerate(labels)]

    strings = label_set(ex("b", "a", "c", "a"))
    assert strings.names == ["a", "b", "c"] and strings.num_classes == 3 and strings.id_of(ex("c")[0]) == 2
    ints = label_set(ex(0, 2))
    assert ints.names is None and ints.num_classes == 3
    assert label_set(ex(0, 1), num_classes=4).num_classes == 4
    with pytest.raises(ValueError, match="mixes kinds"):
        label_set(ex(0, "a"))
    with pytest.raises(ValueError, match="--num-classes 2: f:2 has label 2"):
        label_set(ex(0, 2), num_classes=2)
    with pytest.raises(ValueError, match="at least two classes"):
        label_set(ex("a", "a"))
    with pytest.raises(ValueError, match="out of range"):
        ints.id_of(Example("t", None, 5, "v:1"))
