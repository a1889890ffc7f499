"""`torchrun --nproc_per_node 2 tools/generate.py --tensor-model-parallel-size 2` generates exactly what
one process generates from the same checkpoint (saved under TP=2), greedy and seeded sampling."""

from __future__ import annotations

import json
import sys

import pytest

from tests.e2e.conftest import cpu_env, run_cmd

TRAIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--train-iters", "20", "--lr", "1e-2", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "500", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
         "--device", "cpu"]


def _torchrun(*argv: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", *argv]


@pytest.mark.slow
@pytest.mark.long  # the TP=2 loading and generation also run in test_server_launch's TP=2 server test
def test_tensor_parallel_generation_matches_one_process(tmp_path):
    # Trained long enough on the (learnable) mock data that greedy choices are not near-ties, which
    # the different summation order of TP could otherwise flip.
    env = cpu_env()
    ckpt = tmp_path / "ckpt"
    run_cmd(_torchrun("pretrain_gpt.py", *TRAIN, "--tensor-model-parallel-size", "2", "--save", str(ckpt)), env=env)
    gen = ["tools/generate.py", "--load", str(ckpt), "--prompt", "1 2 3", "--prompt", "7 8 9 10",
           "--tokens-to-generate", "6", "--device", "cpu"]
    for mode in (["--greedy"], ["--temperature", "0.9", "--top-k", "20", "--seed", "5"]):
        one, two = tmp_path / "one.json", tmp_path / "two.json"
        run_cmd([sys.executable, *gen, *mode, "--output-json", str(one)], env=env)
        proc = run_cmd(_torchrun(*gen, *mode, "--tensor-model-parallel-size", "2", "--output-json", str(two)), env=env)
        assert proc.stdout.count("--- prompt:") == 2  # printed once, by the first rank
        assert json.loads(two.read_text()) == json.loads(one.read_text())
        assert all(len(r["tokens"]) == 6 for r in json.loads(one.read_text()))


def test_tensor_parallel_size_must_match_the_launch(tmp_path):
    proc = run_cmd([sys.executable, "tools/generate.py", "--load", str(tmp_path), "--prompt", "1",
                    "--tensor-model-parallel-size", "2"], check=False)
    assert proc.returncode != 0 and "--tensor-model-parallel-size 2 must equal the number of processes (1)" in proc.stderr
