"""The server's OpenAI features (logprobs, echo, n, best_of, seed, logit_bias, chat), Megatron's beam
search, and the HTTP layer's guarantees (keep-alive after a 4xx, Connection: close, 408, 503) over real
HTTP on 127.0.0.1 with the batching engine."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
import torch

from megatrain.data.tokenizers import TokenizerConfig, build_tokenizer
from megatrain.inference.beam_search import beam_search
from megatrain.inference.server import ServerLimits, build_engine, make_context, make_server, model_context
from tests.unit.test_server import TOKENIZER, forward_logprobs, greedy, tiny_model
from tests.unit.test_sft import OWN_TEMPLATE, write_sft_tokenizer

LIMITS = dict(max_prompt_tokens=12, max_tokens_to_generate=8, max_batch_size=8, max_request_bytes=2000)


def serve(ctx):
    srv = make_server(ctx, "127.0.0.1", 0, quiet=True)
    srv.start()
    return srv


@pytest.fixture(scope="module")
def server():
    model = tiny_model()
    srv = serve(model_context(model, build_tokenizer(TOKENIZER), ServerLimits(**LIMITS), max_requests=4))
    yield srv, model
    srv.shutdown()
    srv.server_close()


def request(srv, method, path, body=None, conn=None):
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    data = body if isinstance(body, bytes) else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    if own:
        conn.close()
    return resp.status, payload, resp


def test_echo_logprobs_are_the_models_own(server):
    srv, model = server
    prompt = [1, 2, 3, 4, 5]
    status, out, _ = request(srv, "POST", "/v1/completions", {"prompt": [prompt], "max_tokens": 0, "echo": True,
                                                             "logprobs": 2, "temperature": 0})
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == [str(t) for t in prompt] and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(forward_logprobs(model, prompt), abs=1e-5)
    assert lp["top_logprobs"][0] is None and all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    # lm-evaluation-harness's request: echo + logprobs=1 + max_tokens=1; the generated token's logprob too.
    status, out, _ = request(srv, "POST", "/v1/completions", {"prompt": [prompt], "max_tokens": 1, "echo": True,
                                                             "logprobs": 1, "temperature": 0, "seed": 1234})
    lp = out["choices"][0]["logprobs"]
    new = greedy(model, prompt, 1)
    assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["tokens"][-1] == str(new[0])
    assert lp["token_logprobs"][1:] == pytest.approx(forward_logprobs(model, prompt + new), abs=1e-4)
    assert max(lp["top_logprobs"][-1].values()) == pytest.approx(lp["token_logprobs"][-1], abs=1e-6)


def test_n_best_of_seed_and_logit_bias(server):
    srv, _ = server
    body = {"prompt": ["1 2", "3"], "max_tokens": 6, "temperature": 1.0, "n": 3, "seed": 7, "logprobs": 0}
    status, a, _ = request(srv, "POST", "/v1/completions", body)
    assert status == 200, a
    assert [c["index"] for c in a["choices"]] == list(range(6))
    assert request(srv, "POST", "/v1/completions", body)[1]["choices"] == a["choices"]  # seeded: the same
    status, b, _ = request(srv, "POST", "/v1/completions", {**body, "best_of": 4})
    assert status == 200 and len(b["choices"]) == 6, b
    # +100 on one token: greedy and sampled choices all take it (the end token never comes)
    status, c, _ = request(srv, "POST", "/v1/completions", {"prompt": "1", "max_tokens": 4, "n": 2,
                                                           "logit_bias": {"7": 100}, "temperature": 0.7})
    assert [ch["text"] for ch in c["choices"]] == ["7 7 7 7"] * 2, c
    status, d, _ = request(srv, "POST", "/v1/completions", {"prompt": "1", "max_tokens": 4, "temperature": 0,
                                                           "presence_penalty": 2.0, "frequency_penalty": 2.0})
    assert status == 200, d


def test_beam_search_of_width_one_is_greedy_and_scores_are_sorted(server):
    srv, model = server
    status, out, _ = request(srv, "PUT", "/api", {"prompts": ["1 2 3"], "tokens_to_generate": 5, "beam_width": 1,
                                                 "stop_token": 31})
    assert status == 200, out
    assert out["tokens"] == [[1, 2, 3, *greedy(model, [1, 2, 3], 5)]]
    status, out, _ = request(srv, "PUT", "/api", {"prompts": ["4 5"], "tokens_to_generate": 4, "beam_width": 3})
    assert status == 200 and len(out["text"]) == 3 and out["scores"] == sorted(out["scores"], reverse=True)
    # the function itself: its best beam's score is its tokens' mean log-probability (no stop token met)
    res = beam_search(model, {"prompt_ids": [4, 5], "tokens_to_generate": 4, "beam_size": 3, "stop_token": 31,
                              "length_penalty": 1.0, "vocab_size": 31, "max_positions": 32})
    seq = res["tokens"][0]
    full = model(torch.tensor([seq[:-1]])).float()[0, :, :31].log_softmax(-1)
    mean = full[1:].gather(-1, torch.tensor(seq[2:])[:, None]).sum().item() / 4
    assert res["scores"][0] == pytest.approx(mean, abs=1e-4)


def test_stop_on_eol_needs_a_newline_token(server):
    srv, _ = server
    status, out, _ = request(srv, "PUT", "/api", {"prompts": ["1"], "stop_on_eol": True})
    assert status == 400 and "has no token for" in out["message"]


def test_keep_alive_after_a_4xx_and_connection_close_before_the_body(server):
    srv, _ = server
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    status, out, resp = request(srv, "PUT", "/api", b"{not json", conn)
    assert status == 400 and resp.getheader("Connection") != "close"
    status, out, _ = request(srv, "PUT", "/api", {"prompts": ["1"], "tokens_to_generate": 1, "top_k": 1}, conn)
    assert status == 200, out  # the same connection served the next request
    conn.close()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        head = recv_until_closed(sock)
        assert head.startswith("HTTP/1.1 413") and "connection: close" in head.lower()


def recv_until_closed(sock: socket.socket) -> str:
    """Everything the server sends until it closes the connection (head and body may come apart)."""
    chunks = []
    while chunk := sock.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_slow_body_408_and_a_full_engine_503(tmp_path):
    model = tiny_model()
    tok = build_tokenizer(TOKENIZER)
    engine = build_engine(model, max_requests=1, max_sequence_length=32, max_waiting=0)
    srv = serve(make_context(engine, model, tok, ServerLimits(**LIMITS, body_timeout_s=0.5)))
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            sock.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
            head = recv_until_closed(sock)
            assert head.startswith("HTTP/1.1 408") and "connection: close" in head.lower()
            assert "not received within 0.5 s" in head
        # two sequences for one slot and no waiting room: 503 with Retry-After. The engine thread is held
        # in a call meanwhile, so the first sequence cannot finish before the second is submitted.
        release = threading.Event()
        engine.register("hold", lambda _model, _payload: release.wait(30))
        held = engine.call("hold", {})
        try:
            status, out, resp = request(srv, "POST", "/v1/completions", {"prompt": "1", "n": 2, "max_tokens": 8})
        finally:
            release.set()
            held.result(timeout=30)
        assert status == 503 and resp.getheader("Retry-After") == "1" and "busy" in out["message"]
        assert request(srv, "GET", "/health")[0] == 200
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    folder = write_sft_tokenizer(tmp_path_factory.mktemp("chat_tok"), chat_template=OWN_TEMPLATE)
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=folder))
    model = tiny_model()
    srv = serve(model_context(model, tok, ServerLimits(**{**LIMITS, "max_prompt_tokens": 30}), max_requests=4))
    yield srv, model, tok
    srv.shutdown()
    srv.server_close()


def test_chat_completions_render_the_template(chat_server):
    srv, model, tok = chat_server
    messages = [{"role": "user", "content": "hello"}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    status, out, _ = request(srv, "POST", "/v1/chat/completions", body)
    assert status == 200, out
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    new = [t for t in greedy(model, ids, 4)]
    eos = tok.eod
    body_ids = new[:new.index(eos)] if eos in new else new
    choice = out["choices"][0]
    assert out["object"] == "chat.completion" and choice["message"] == {"role": "assistant",
                                                                        "content": tok.detokenize(body_ids)}
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.detokenize([t]) for t in body_ids]
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert out["usage"]["prompt_tokens"] == len(ids)
    # streamed: a role delta, content deltas adding up to the same text, a finish reason, [DONE]
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}).encode())
    raw = conn.getresponse().read().decode()
    events = [e[len("data: "):] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
    assert text == choice["message"]["content"] and chunks[-1]["choices"][0]["finish_reason"] is not None


class SlowEngine:
    """The server's engine with a pause after every event (so a job outlives its client) and a record
    of each job's last event."""

    def __init__(self, engine) -> None:
        self.engine, self.max_sequence_length = engine, engine.max_sequence_length
        self.last: list[str | None] = []

    def submit(self, job, on_event):
        index = len(self.last)
        self.last.append(None)

        def slow(event):
            on_event(event)
            if event.finish_reason is not None:
                self.last[index] = event.finish_reason
            time.sleep(0.05)

        return self.engine.submit(job, slow)

    def call(self, name, payload):
        return self.engine.call(name, payload)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_cancels_its_jobs(server, stream):
    srv, _ = server
    real = srv.ctx.engine
    slow = srv.ctx.engine = SlowEngine(real)
    try:
        body = json.dumps({"prompt": ["1 2"] * 4, "max_tokens": 8, "temperature": 0, "stream": stream}).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            if stream:
                assert sock.recv(16).startswith(b"HTTP/1.1 200")
            else:
                time.sleep(0.2)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and None in slow.last:
            time.sleep(0.05)
        assert slow.last == ["cancelled"] * 4
    finally:
        srv.ctx.engine = real
    status, out, _ = request(srv, "POST", "/v1/completions", {"prompt": "3", "max_tokens": 2, "temperature": 0})
    assert status == 200 and out["choices"][0]["text"]


def test_model_list(server):
    srv, _ = server
    status, out, _ = request(srv, "GET", "/v1/models")
    assert status == 200 and out["data"][0]["id"] == "megatrain"



class Favourite(torch.nn.Module):
    """Logits that always rank ``order`` first, second, ... (a model for the token rules)."""

    def __init__(self, vocab: int, order: list[int]) -> None:
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.vocab, self.order = vocab, order

    def forward(self, tokens, position_ids=None, kv_cache=None, attention_mask=None):
        logits = torch.zeros(*tokens.shape, self.vocab)
        for rank, token in enumerate(self.order):
            logits[..., token] = 10.0 - rank
        return logits


def test_prevent_newline_after_colon_bans_the_newline_after_a_colon():
    from megatrain.inference.model_calls import generate_banning_newline

    colon, newline, other = 5, 7, 3
    model = Favourite(10, [newline, colon, other])
    payload = {"prompts": [[1, colon], [1, 2]], "max_new_tokens": 3, "greedy": True, "temperature": 1.0, "top_k": 0,
               "top_p": 0.0, "seeds": [1, 2], "eod": None, "newline_after_colon": [colon, newline], "vocab_size": 10}
    out = generate_banning_newline(model, payload)
    assert [o["tokens"] for o in out] == [[colon, colon, colon], [newline, newline, newline]]
    # beam search follows the same rule
    res = beam_search(model, {"prompt_ids": [1, colon], "tokens_to_generate": 2, "beam_size": 1, "stop_token": 9,
                              "length_penalty": 1.0, "vocab_size": 10, "newline_after_colon": [colon, newline]})
    assert res["tokens"][0] == [1, colon, colon, colon]


def test_an_sft_prompt_format_renders_the_chat(tmp_path):
    from megatrain.inference.chat import render_conversation

    folder = write_sft_tokenizer(tmp_path / "tok")
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="SFTTokenizer", tokenizer_model=folder,
                                          sft_tokenizer_prompt_format="nemotron-h-aligned"))
    text, ids = render_conversation(tok, [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hello"}])
    assert text == "<SPECIAL_10>System\nbe brief\n<SPECIAL_11>User\nhello\n<SPECIAL_11>Assistant\n"
    assert ids == tok.encode(text, add_special_tokens=False)


def test_megatron_newline_rules_with_a_gpt2_tokenizer():
    from pathlib import Path

    data = Path(__file__).resolve().parents[3] / "shared/data/gpt2"
    if not (data / "gpt2-vocab.json").is_file():
        pytest.skip("../shared/data/gpt2 is not available")
    from megatrain.models.gpt import GPTModel
    from megatrain.models.gpt.config import GPTConfig

    tok = build_tokenizer({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": str(data / "gpt2-vocab.json"),
                           "merge_file": str(data / "gpt2-merges.txt")})
    model = GPTModel(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=50304,
                               max_position_embeddings=64, init_method_std=0.3))
    model.init_weights(seed=1)
    srv = serve(model_context(model.eval(), tok, ServerLimits(**LIMITS), max_requests=2))
    try:
        for extra in ({"prevent_newline_after_colon": True}, {"stop_on_eol": True}, {"stop_on_double_eol": True},
                      {"prevent_newline_after_colon": True, "beam_width": 2}):
            body = {"prompts": ["Answer:"], "tokens_to_generate": 4, "top_k": 1, **extra}
            status, out, _ = request(srv, "PUT", "/api", {**body, "logprobs": "beam_width" not in extra})
            assert status == 200, (extra, out)
            assert out["tokens"][0][:2] == tok.tokenize("Answer:")
            assert tok.tokenize("\n")[0] != out["tokens"][0][2] or not extra.get("prevent_newline_after_colon")
    finally:
        srv.shutdown()
        srv.server_close()


def test_streamed_logprobs_add_up_to_the_plain_answer(server):
    srv, _ = server
    body = {"prompt": ["1 2 3", "4"], "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True}
    status, plain, _ = request(srv, "POST", "/v1/completions", body)
    assert status == 200, plain
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}).encode())
    raw = conn.getresponse().read().decode()
    chunks = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    for choice in plain["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(m["text"] for m in mine) == choice["text"]
        for key in ("tokens", "token_logprobs", "text_offset"):
            streamed = sum((m["logprobs"][key] for m in mine if m["logprobs"]), [])
            if key == "token_logprobs":  # batched with other sequences or not: equal to rounding
                assert streamed[0] is None and streamed[1:] == pytest.approx(choice["logprobs"][key][1:], abs=1e-5)
            else:
                assert streamed == choice["logprobs"][key]


def test_chunked_bodies_and_bad_lengths(server):
    srv, _ = server
    body = json.dumps({"prompts": ["1 2"], "tokens_to_generate": 2, "top_k": 1}).encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 12x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 400")


def test_too_many_requests_at_once_get_503(server):
    srv, _ = server
    real, limit = srv.ctx.engine, srv.ctx.limits.max_pending_requests
    srv.ctx.engine = SlowEngine(real)
    app = srv.server.config.app  # the RequestLimit middleware
    app.limit = 1
    try:
        body = json.dumps({"prompt": "1", "max_tokens": 8, "temperature": 0}).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.1)
            status, out, resp = request(srv, "POST", "/v1/completions", {"prompt": "2", "max_tokens": 1})
            assert status == 503 and resp.getheader("Retry-After") == "1", out
            assert request(srv, "GET", "/health")[0] == 200  # not counted
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        app.limit = limit
        srv.ctx.engine = real
