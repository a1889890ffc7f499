"""The text-generation server over real HTTP on 127.0.0.1 (uvicorn, the batching engine): Megatron's and
OpenAI's endpoints, concurrent requests, and a 4xx with a message (never a crash) for each kind of bad
input; the command starts from a checkpoint."""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatrain.data.tokenizers import build_tokenizer
from megatrain.inference.generation import generate
from megatrain.inference.server import ServerLimits, model_context, make_server
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel
from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import TrainState

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = {"tokenizer_type": "NullTokenizer", "vocab_size": 30}  # text is ids; eod = 30


def tiny_model() -> GPTModel:
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=32,
                               max_position_embeddings=32, init_method_std=0.3))
    model.init_weights(seed=5)
    return model.eval()


@pytest.fixture(scope="module")
def server():
    model = tiny_model()
    ctx = model_context(model, build_tokenizer(TOKENIZER),
                        ServerLimits(max_prompt_tokens=12, max_tokens_to_generate=8, max_batch_size=4,
                                     max_request_bytes=2000), max_requests=4)
    srv = make_server(ctx, "127.0.0.1", 0, quiet=True)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv, model
    srv.shutdown()
    srv.server_close()


def request(srv, method: str, path: str, body=None, raw: bytes | None = None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers=headers or {"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    conn.close()
    return resp.status, payload


def greedy(model, prompt: list[int], n: int) -> list[int]:
    return generate(model, [prompt], n, eod=30)[0]


def forward_logprobs(model, seq: list[int]) -> list[float]:
    """Every token's log-probability after the first, from one full forward."""
    import torch

    with torch.no_grad():
        logp = model(torch.tensor([seq[:-1]])).float().log_softmax(-1)[0]
    return logp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].tolist()


def test_megatron_api(server):
    srv, model = server
    status, out = request(srv, "PUT", "/api", {"prompts": ["1 2 3", "4 5"], "tokens_to_generate": 5, "top_k": 1,
                                               "logprobs": True})
    assert status == 200, out
    for prompt, text, segments, tokens, logprobs in zip([[1, 2, 3], [4, 5]], out["text"], out["segments"],
                                                        out["tokens"], out["logprobs"]):
        new = greedy(model, prompt, 5)
        assert text == " ".join(map(str, prompt + new)) and segments == [str(t) for t in prompt + new]
        assert tokens == prompt + new
        assert logprobs == pytest.approx(forward_logprobs(model, prompt + new), abs=1e-4)
    # Sampling with a seed is reproducible.
    body = {"prompts": ["7"], "tokens_to_generate": 6, "temperature": 0.9, "top_p": 0.8, "random_seed": 3}
    assert request(srv, "PUT", "/api", body)[1] == request(srv, "PUT", "/api", body)[1]


def test_openai_completions(server):
    srv, model = server
    status, out = request(srv, "POST", "/v1/completions", {"prompt": "1 2 3", "max_tokens": 6, "temperature": 0})
    assert status == 200, out
    new = greedy(model, [1, 2, 3], 6)
    choice = out["choices"][0]
    assert out["object"] == "text_completion" and choice["index"] == 0
    expected = " ".join(map(str, [t for t in new if t != 30]))
    assert choice["text"] == expected
    assert choice["finish_reason"] == ("stop" if 30 in new else "length")
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": len(new), "total_tokens": 3 + len(new)}
    # A stop string cuts the text and ends the completion.
    if len(new) > 2 and 30 not in new[:3]:
        stop = str(new[1])
        status, out = request(srv, "POST", "/v1/completions", {"prompt": ["1 2 3"], "max_tokens": 6,
                                                               "temperature": 0, "stop": stop, "echo": True})
        assert status == 200 and out["choices"][0]["finish_reason"] == "stop"
        assert out["choices"][0]["text"].startswith("1 2 3") and stop not in out["choices"][0]["text"][5:]


def stream(srv, body: dict) -> tuple[str, list]:
    """POST a streaming completions request; (content type, decoded events, "[DONE]" kept as a string)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    raw = resp.read().decode("utf-8")
    conn.close()
    events = [e[len("data: "):] for e in raw.split("\n\n") if e]
    return resp.getheader("Content-Type"), [e if e == "[DONE]" else json.loads(e) for e in events]


def streamed_texts(events: list, n: int) -> tuple[list[str], list[str | None], int]:
    """Concatenated text and final finish_reason per choice, and the number of text chunks."""
    texts, reasons, chunks = [""] * n, [None] * n, 0
    for e in events[:-1]:
        for c in e["choices"]:
            assert reasons[c["index"]] is None, "no chunk after a choice's finish_reason"
            texts[c["index"]] += c["text"]
            reasons[c["index"]] = c["finish_reason"]
            chunks += bool(c["text"])
    return texts, reasons, chunks


@pytest.mark.parametrize("extra", [{}, {"stop": "5"}, {"stop": ["2 1", "7"], "echo": True}],
                         ids=["plain", "stop", "stops_echo"])
def test_streamed_completion_adds_up_to_the_plain_answer(server, extra):
    srv, _ = server
    body = {"prompt": ["1 2 3", "4 5", "9"], "max_tokens": 8, "temperature": 0, **extra}
    status, plain = request(srv, "POST", "/v1/completions", body)
    assert status == 200
    content_type, events = stream(srv, {**body, "stream_options": {"include_usage": True}})
    assert content_type == "text/event-stream" and events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"] == plain["usage"]
    texts, reasons, chunks = streamed_texts(events[:-1], 3)
    assert texts == [c["text"] for c in plain["choices"]]
    assert reasons == [c["finish_reason"] for c in plain["choices"]]
    assert chunks > 3, "text should arrive in pieces, not all at the end"
    assert len({e["id"] for e in events[:-1]}) == 1


def test_client_leaving_a_stream_does_not_stop_the_server(server):
    import socket

    srv, _ = server
    body = json.dumps({"prompt": ["1 2"] * 4, "max_tokens": 8, "temperature": 0, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
    status, out = request(srv, "POST", "/v1/completions", {"prompt": "3", "max_tokens": 2, "temperature": 0})
    assert status == 200 and out["choices"][0]["text"]


def test_streamed_text_holds_back_partial_characters_and_stop_prefixes():
    from megatrain.inference.openai_generation import StreamedText as _StreamedText

    if not (REPO.parent / "shared/data/gpt2/gpt2-vocab.json").is_file():
        pytest.skip("../shared/data/gpt2 is not available")
    tok = build_tokenizer({"tokenizer_type": "GPT2BPETokenizer",
                           "vocab_file": str(REPO.parent / "shared/data/gpt2/gpt2-vocab.json"),
                           "merge_file": str(REPO.parent / "shared/data/gpt2/gpt2-merges.txt")})
    text = "Grüße aus Köln 😀 und 日本語, then STOP here"
    ids = tok.tokenize(text)
    for stops, expected in (([], text), (["STOP"], text[:text.index("STOP")]), (["Köln 😀 und"], "Grüße aus ")):
        streamed = _StreamedText(tok, stops)
        deltas = [streamed.add(t) for t in ids]
        assert all("\ufffd" not in d for d in deltas), "a partial UTF-8 character was sent"
        assert "".join(deltas) + streamed.rest(expected) == expected
        if stops:
            assert not any(s in "".join(deltas) for s in stops)


def test_concurrent_requests(server):
    srv, model = server
    prompts = [[i % 29, (3 * i) % 29] for i in range(12)]
    expected = [" ".join(map(str, p + greedy(model, p, 4))) for p in prompts]

    def one(i):
        return request(srv, "PUT", "/api", {"prompts": [" ".join(map(str, prompts[i]))], "tokens_to_generate": 4,
                                            "top_k": 1})

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(one, range(12)))
    assert [r[0] for r in results] == [200] * 12
    assert [r[1]["text"][0] for r in results] == expected


@pytest.mark.parametrize("method, path, body, status, message", [
    ("PUT", "/api", b"{not json", 400, "not valid JSON"),
    ("PUT", "/api", b"[1, 2]", 400, "must be a JSON object"),
    ("PUT", "/api", {"tokens_to_generate": 4}, 400, "prompts argument required"),
    ("PUT", "/api", {"prompts": "1 2"}, 400, "prompts is not a list of strings"),  # Megatron's check
    ("PUT", "/api", {"prompts": []}, 400, "prompts is empty"),
    ("PUT", "/api", {"prompts": [""]}, 400, "Empty prompts require add_BOS=true"),
    ("PUT", "/api", {"prompts": [3]}, 400, "prompts[0] must be a string"),
    ("PUT", "/api", {"prompts": ["1 " * 13]}, 400, "limit is 12"),
    ("PUT", "/api", {"prompts": ["1"] * 5}, 400, "at most 4 prompts"),
    ("PUT", "/api", {"prompts": ["1"], "tokens_to_generate": "4"}, 400, "greater than or equal to 0"),
    ("PUT", "/api", {"prompts": ["1"], "tokens_to_generate": 9}, 400, "limit is 8"),
    ("PUT", "/api", {"prompts": ["1"], "tokens_to_generate": 0}, 400, "logprobs should be True"),
    ("PUT", "/api", {"prompts": ["1"], "temperature": 0}, 400, "temperature must be a positive number"),
    ("PUT", "/api", {"prompts": ["1"], "top_k": 2, "top_p": 0.5}, 400, "cannot set both"),
    ("PUT", "/api", {"prompts": ["1"], "top_k": True}, 400, "top_k must be an integer"),
    ("PUT", "/api", {"prompts": ["1"], "random_seed": -1}, 400, "random_seed must be a positive integer"),
    ("PUT", "/api", {"prompts": ["1"], "prevent_newline_after_colon": True}, 400, "has no token for ':'"),
    ("PUT", "/api", {"prompts": ["1"] * 129}, 400, "Maximum number of prompts is 128"),
    ("PUT", "/api", {"prompts": ["1"], "random_seed": 1.5}, 400, "random_seed must be integer"),
    ("PUT", "/api", {"prompts": ["1"], "max_len": 3}, 400, "max_len is no longer used"),
    ("PUT", "/api", {"prompts": ["1"], "sentences": ["1"]}, 400, "sentences is no longer used"),
    ("PUT", "/api", {"prompts": ["1"], "top_p_decay": 0.5}, 400, "top_p_decay cannot be set without top_p"),
    ("PUT", "/api", {"prompts": ["1"], "top_p": 0.5, "top_p_bound": 0.9}, 400, "top_p_bound must be greater"),
    ("PUT", "/api", {"prompts": ["1", "2"], "beam_width": 2}, 400, "batch size must be 1"),
    ("PUT", "/api", {"prompts": ["1"], "beam_width": 0}, 400, "beam_width must be an integer > 1"),
    ("PUT", "/api", {"prompts": ["1"], "length_penalty": "x"}, 400, "length_penalty must be a float"),
    ("PUT", "/api", {"prompts": ["1"], "stop_on_eol": 1}, 400, "stop_on_eol must be a boolean value"),
    ("PUT", "/api", {"prompts": ["1"], "add_BOS": "yes"}, 400, "add_BOS must be a boolean value"),
    ("PUT", "/api", {"prompts": ["1"], "no_log": 0}, 400, "no_log must be a boolean value"),
    ("PUT", "/api", {"prompts": ["1"], "stop_token": "x"}, 400, "stop_token must be an integer"),
    ("PUT", "/api", {"prompts": ["1"], "colour": 1}, 400, "does not take the field 'colour'"),
    ("PUT", "/api", {"prompts": ["1 99"]}, 400, "NullTokenizer id 99"),
    ("POST", "/v1/completions", {"max_tokens": 3}, 400, "prompt is required"),
    ("POST", "/v1/completions", {"prompt": "1", "max_tokens": -1}, 400, "non-negative integer"),
    ("POST", "/v1/completions", {"prompt": "1", "stop": [1]}, 400, "stop must be"),
    ("POST", "/v1/completions", {"prompt": "1", "stream": "yes"}, 400, "stream must be a boolean"),
    ("POST", "/v1/completions", {"prompt": [""], "stream": True}, 400, "prompt[0] is empty"),
    ("POST", "/v1/completions", {"prompt": "1", "stream": True, "stream_options": 3}, 400, "stream_options"),
    ("POST", "/v1/completions", {"prompt": "1", "n": 0}, 400, "n must be a positive integer"),
    ("POST", "/v1/completions", {"prompt": "1", "n": 2, "best_of": 1}, 400, "best_of must be an integer at least n"),
    ("POST", "/v1/completions", {"prompt": "1", "n": 2, "best_of": 3, "stream": True}, 400, "cannot be streamed"),
    ("POST", "/v1/completions", {"prompt": "1", "suffix": "2"}, 400, "suffix is not supported"),
    ("POST", "/v1/completions", {"prompt": "1", "colour": 1}, 400, "does not take the field 'colour'"),
    ("POST", "/v1/completions", {"prompt": "1", "logprobs": True}, 400, "logprobs must be an integer"),
    ("POST", "/v1/completions", {"prompt": "1", "logprobs": 21}, 400, "logprobs must be an integer"),
    ("POST", "/v1/completions", {"prompt": "1", "logit_bias": {"x": 1}}, 400, "not a token id"),
    ("POST", "/v1/completions", {"prompt": "1", "logit_bias": {"99": 1}}, 400, "not in 0..30"),
    ("POST", "/v1/completions", {"prompt": "1", "logit_bias": {"3": 101}}, 400, "from -100 to 100"),
    ("POST", "/v1/completions", {"prompt": "1", "presence_penalty": 3}, 400, "presence_penalty must be"),
    ("POST", "/v1/completions", {"prompt": [[1, 99]]}, 400, "token id 99 is not in 0..30"),
    ("POST", "/v1/completions", {"prompt": "1", "stream_options": {"include_usage": True}}, 400,
     "only allowed with"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}]}, 400,
     "has no chat template"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages must be a non-empty list"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "1"}]}, 400, "role must be"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}], "tools": []}, 400,
     "does not take the field 'tools'"),
    ("POST", "/v1/completions", {"prompt": "1", "temperature": "hot"}, 400, "temperature must be"),
    ("GET", "/api", None, 405, "is not served"),
    ("POST", "/v2/other", {}, 404, "endpoints"),
    ("PUT", "/api", b"x" * 3000, 413, "byte limit"),
])
def test_bad_requests_get_4xx_with_message(server, method, path, body, status, message):
    srv, _ = server
    raw = body if isinstance(body, bytes) else None
    got, out = request(srv, method, path, None if raw is not None else body, raw=raw)
    assert got == status, out
    if message:
        assert message in out["message"]
    assert request(srv, "GET", "/health")[0] == 200  # still serving


def test_missing_content_length_and_prompt_plus_tokens_over_positions(server):
    srv, _ = server
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    conn.putrequest("PUT", "/api")
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 411 and "Content-Length" in json.loads(resp.read())["message"]
    conn.close()
    status, out = request(srv, "PUT", "/api", {"prompts": ["1 " * 12], "tokens_to_generate": 8})
    assert status == 200  # 12 + 8 - 1 <= 32 positions
    long_limits = srv.ctx.limits
    old = long_limits.max_prompt_tokens
    long_limits.max_prompt_tokens = 40
    try:
        status, out = request(srv, "PUT", "/api", {"prompts": ["1 " * 30], "tokens_to_generate": 8})
        assert status == 400 and "exceeds the model's 32 positions" in out["message"], out
    finally:
        long_limits.max_prompt_tokens = old


def test_command_serves_a_checkpoint(tmp_path):
    model = tiny_model()
    checkpointing.save_checkpoint(str(tmp_path / "ckpt"), TrainState(iteration=1), model, None, {},
                                  argparse.Namespace(**TOKENIZER), model.config)
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "run_text_generation_server.py"), "--load",
                             str(tmp_path / "ckpt"), "--port", "0", "--quiet", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        line = proc.stdout.readline()
        assert "serving on http://127.0.0.1:" in line, line + proc.stderr.read()
        port = int(line.rsplit(":", 1)[1].split()[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("PUT", "/api", body=json.dumps({"prompts": ["1 2"], "tokens_to_generate": 3, "top_k": 1}))
        out = json.loads(conn.getresponse().read())
        conn.close()
        assert out["text"] == [" ".join(map(str, [1, 2] + greedy(model, [1, 2], 3)))]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
