"""Megatron's SFT form end to end: ``pretrain_gpt.py --sft --tokenizer-type SFTTokenizer --tokenizer-model DIR
--sft-tokenizer-prompt-format nemotron-nano-v2 --data-path FILE.jsonl`` trains a tiny model from scratch
(the loss is finite and falls), and a bad line stops it with one line naming the file and line."""

from __future__ import annotations

import json
import math
import random
import re
import sys

from tests.e2e.conftest import cpu_env, run_cmd
from tests.unit.test_sft import write_sft_tokenizer

WORDS = ["hello", "world", "hi", "there", "be", "brief", "bye", "now"]


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", stdout)]


def test_pretrain_gpt_sft_trains_on_conversations(tmp_path):
    tok = write_sft_tokenizer(tmp_path / "tok")
    rng = random.Random(0)
    data = tmp_path / "chat.jsonl"
    with open(data, "w") as f:
        for _ in range(48):  # the assistant repeats the user's words backwards
            words = [rng.choice(WORDS) for _ in range(rng.randint(1, 4))]
            f.write(json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": " ".join(words)},
                                             {"role": "assistant", "content": " ".join(words[::-1])}]}) + "\n")
    argv = [sys.executable, "pretrain_gpt.py", "--sft", "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", tok,
            "--sft-tokenizer-prompt-format", "nemotron-nano-v2", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--make-vocab-size-divisible-by", "8",
            "--lr", "3e-3", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--split", "100,0,0"]
    proc = run_cmd([*argv, "--data-path", str(data), "--train-iters", "3"], env=cpu_env())
    losses = _losses(proc.stdout)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses

    with open(data, "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    bad = run_cmd([*argv, "--data-path", str(data), "--train-iters", "1"], env=cpu_env(), check=False)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == (f"error: --data-path {data}:49: the conversation has no assistant "
                                                   "message, so nothing to train on")
