"""tools/run_text_generation_server.py launched as Megatron's scripts launch it: under torchrun with
--tensor-model-parallel-size 2 (rank 0 answers HTTP, both ranks run the engine) it answers what one
process answers; shape flags that differ from the checkpoint and pipeline parallelism are refused in
one line."""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import TrainState
from megatrain.models.gpt import GPTModel
from megatrain.models.gpt.config import GPTConfig

REPO = Path(__file__).resolve().parents[2]
TOOL = str(REPO / "tools" / "run_text_generation_server.py")
TOKENIZER = {"tokenizer_type": "NullTokenizer", "vocab_size": 30}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=32,
                               max_position_embeddings=32, init_method_std=0.3))
    model.init_weights(seed=5)
    path = tmp_path_factory.mktemp("serve") / "ckpt"
    checkpointing.save_checkpoint(str(path), TrainState(iteration=1), model, None, {}, argparse.Namespace(**TOKENIZER),
                                  model.config)
    return path


def ask(port: int, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("PUT", "/api", body=json.dumps(body).encode())
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, out
    return out


def serve(argv: list[str]) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    line = proc.stdout.readline()
    if "serving on http://127.0.0.1:" not in line:
        proc.kill()
        raise AssertionError(line + proc.stderr.read())
    return proc, int(line.split("http://127.0.0.1:")[1].split()[0])


MEGATRON_FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                  "--max-position-embeddings", "32", "--seq-length", "32", "--micro-batch-size", "1", "--seed", "42",
                  "--use-checkpoint-args", "--pipeline-model-parallel-size", "1", "--inference-max-requests", "4"]


@pytest.mark.slow
# --frontend-process under TP=2 is `long` (~14 s): the TP=2 server is the one_process case's, the front end's
# child process test_frontend_process_server_answers_and_stops_with_its_parent's
@pytest.mark.parametrize("frontend", [[], pytest.param(["--frontend-process"], marks=pytest.mark.long)],
                         ids=["one_process", "frontend_process"])
def test_tensor_parallel_server_answers_as_one_process(ckpt, frontend):
    """torchrun TP=2 answers as one process, also with ``--frontend-process`` (rank 0's engine behind the
    child's HTTP app, the other rank following); a registered call (beam search) runs on both ranks."""
    body = {"prompts": ["1 2 3", "4 5"], "tokens_to_generate": 6, "top_k": 1, "logprobs": True}
    one, port = serve([sys.executable, TOOL, "--load", str(ckpt), "--port", "0", "--quiet", "--device", "cpu",
                       *MEGATRON_FLAGS])
    try:
        want = ask(port, body)
    finally:
        one.terminate()
        one.wait(timeout=30)
    two, port = serve([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                       TOOL, "--load", str(ckpt), "--port", "0", "--quiet", "--device", "cpu",
                       "--tensor-model-parallel-size", "2", *frontend, *MEGATRON_FLAGS])
    try:
        got = ask(port, body)
        beam = ask(port, {"prompts": ["1 2"], "tokens_to_generate": 4, "beam_width": 2})  # a call on both ranks
        assert len(beam["text"]) == 2
    finally:
        two.terminate()
        two.wait(timeout=60)
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"]
    assert got["logprobs"] == [pytest.approx(lp, abs=1e-4) for lp in want["logprobs"]]


@pytest.mark.parametrize("flags, message", [
    (["--hidden-size", "64"], "--hidden-size 64 does not match the checkpoint's hidden_size = 32"),
    (["--swiglu"], "--swiglu does not match the checkpoint"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size must be 1"),
])
def test_refusals_are_one_line(ckpt, flags, message):
    proc = subprocess.run([sys.executable, TOOL, "--load", str(ckpt), "--port", "0", "--device", "cpu", *flags],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]


def test_frontend_process_server_answers_and_stops_with_its_parent(ckpt):
    """--frontend-process: HTTP from a child process, the engine in the launched one; the answer is the
    model's greedy continuation, and SIGTERM to the launched process stops both (the port closes)."""
    import torch

    from megatrain.inference.generation import generate
    from megatrain.inference.loading import load_model

    proc, port = serve([sys.executable, TOOL, "--load", str(ckpt), "--port", "0", "--quiet", "--device", "cpu",
                        "--frontend-process", *MEGATRON_FLAGS])
    try:
        out = ask(port, {"prompts": ["1 2 3"], "tokens_to_generate": 6, "top_k": 1})
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    model, _ = load_model(str(ckpt), torch.device("cpu"))
    assert out["tokens"][0][3:] == generate(model.eval(), [[1, 2, 3]], 6, eod=30)[0]
    import socket
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the child notices its parent is gone and stops listening
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the front end's process still listens after its parent ended")
