"""finetune_gpt.py end to end: pre-train briefly, then fine-tune from the checkpoint with --finetune on a
prompt/response jsonl; the (response-only) loss falls; --sft-pack runs too; the result generates."""

from __future__ import annotations

import json
import random
import re
import sys

from tests.e2e.conftest import run_cmd

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "8", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "17", "--make-vocab-size-divisible-by", "8", "--num-workers", "0",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0"]


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", stdout)]


def test_finetune_from_pretrained_checkpoint(tmp_path):
    rng = random.Random(0)
    data = tmp_path / "reverse.jsonl"
    with open(data, "w") as f:
        for _ in range(200):
            xs = [rng.randrange(16) for _ in range(rng.randint(2, 5))]
            f.write(json.dumps({"prompt": " ".join(map(str, xs)) + " 16",
                                "response": " ".join(map(str, xs[::-1]))}) + "\n")
    run_cmd([sys.executable, "pretrain_gpt.py", *MODEL, "--mock-data", "--train-iters", "4", "--lr", "1e-3",
             "--log-interval", "2", "--save", str(tmp_path / "pre")])
    proc = run_cmd([sys.executable, "finetune_gpt.py", *MODEL, "--data-path", str(data), "--split", "100,0,0",
                    "--train-iters", "40", "--lr", "3e-3", "--log-interval", "10", "--load", str(tmp_path / "pre"),
                    "--finetune", "--save", str(tmp_path / "sft")])
    assert "finetune: iteration and optimizer reset" in proc.stdout
    losses = _losses(proc.stdout)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, losses

    packed = run_cmd([sys.executable, "finetune_gpt.py", *MODEL, "--data-path", str(data), "--split", "90,10,0",
                      "--sft-pack", "--train-iters", "4", "--lr", "3e-3", "--log-interval", "2", "--eval-iters", "1",
                      "--eval-interval", "4", "--load", str(tmp_path / "sft"), "--finetune"])
    assert len(_losses(packed.stdout)) == 2 and "validation loss at iteration 4" in packed.stdout

    bad = run_cmd([sys.executable, "finetune_gpt.py", *MODEL, "--data-path", str(tmp_path / "missing.jsonl"),
                   "--train-iters", "1", "--lr", "1e-3"], check=False)
    assert bad.returncode != 0 and "missing.jsonl: cannot open" in bad.stderr and "Traceback" not in bad.stderr
