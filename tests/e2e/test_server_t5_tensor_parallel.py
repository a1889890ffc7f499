"""tools/run_text_generation_server.py on a T5 (encoder-decoder) checkpoint under torchrun with
--tensor-model-parallel-size 2: rank 0 answers HTTP and broadcasts each registered call (T5
generation) to the other rank, which runs it on its shard (CallOnlyEngine.follow); PUT /api and
POST /v1/completions answer with the tokens one process answers."""

from __future__ import annotations

import http.client
import json
import sys
from pathlib import Path

import pytest

from tests.e2e.test_server_launch import TOOL, ask, serve
from tests.unit.t5_tiny import random_model, save, write_vocab

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["the cat sat on the mat", "hello <extra_id_0> world"]


@pytest.fixture(scope="module")
def t5_ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve_t5")
    return save(random_model("tied_swiglu", seed=3), root / "ckpt", write_vocab(root / "vocab.txt"))


def complete(port: int, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, out
    return out


def answers(port: int) -> tuple[dict, dict, dict]:
    greedy = ask(port, {"prompts": PROMPTS, "tokens_to_generate": 6, "top_k": 1, "logprobs": True})
    sampled = ask(port, {"prompts": PROMPTS[:1], "tokens_to_generate": 5, "top_k": 4, "random_seed": 7})
    openai = complete(port, {"prompt": PROMPTS, "max_tokens": 5, "temperature": 0})
    return greedy, sampled, openai


@pytest.mark.slow
def test_t5_tensor_parallel_server_answers_as_one_process(t5_ckpt):
    flags = ["--load", str(t5_ckpt), "--port", "0", "--quiet", "--device", "cpu"]
    one, port = serve([sys.executable, TOOL, *flags])
    try:
        want = answers(port)
    finally:
        one.terminate()
        one.wait(timeout=30)
    two, port = serve([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                       TOOL, *flags, "--tensor-model-parallel-size", "2"])
    try:
        got = answers(port)
        again = answers(port)  # the follower stays in step call after call
    finally:
        two.terminate()
        two.wait(timeout=60)
    for g, w in zip(got, want):
        g.pop("id", None), g.pop("created", None), w.pop("id", None), w.pop("created", None)
    assert got[0]["segments"] == want[0]["segments"] and got[0]["text"] == want[0]["text"]
    assert [lp for row in got[0]["logprobs"] for lp in row] == pytest.approx(
        [lp for row in want[0]["logprobs"] for lp in row], abs=1e-4)
    assert got[1]["text"] == want[1]["text"]
    assert [c["text"] for c in got[2]["choices"]] == [c["text"] for c in want[2]["choices"]]
    assert again[0]["segments"] == got[0]["segments"] and again[2]["choices"] == got[2]["choices"]
