"""The server under load through the real ``openai`` client: 24 concurrent clients (plain and streamed
completions) get exactly the greedy answers while one client holds a streaming request it never reads
from (a tiny receive buffer, big chunks): it blocks neither the engine nor anyone else."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatrain.data.tokenizers import build_tokenizer
from megatrain.inference.generation import generate
from megatrain.inference.server import ServerLimits, make_server, model_context
from megatrain.models.gpt import GPTModel
from megatrain.models.gpt.config import GPTConfig

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server():
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=32,
                               max_position_embeddings=64, init_method_std=0.3))
    model.init_weights(seed=11)
    model.eval()
    ctx = model_context(model, build_tokenizer({"tokenizer_type": "NullTokenizer", "vocab_size": 30}),
                        ServerLimits(max_prompt_tokens=16, max_tokens_to_generate=40, max_batch_size=8),
                        max_requests=8)
    srv = make_server(ctx, "127.0.0.1", 0, quiet=True)
    srv.start()
    yield srv, model
    srv.shutdown()
    srv.server_close()


def expected_text(model, prompt: list[int], n: int) -> str:
    new = generate(model, [prompt], n, eod=30)[0]
    return " ".join(str(t) for t in new if t != 30)


def test_many_openai_clients_beside_a_stalled_stream(server):
    srv, model = server
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    stalled.connect(("127.0.0.1", srv.port))
    body = json.dumps({"prompt": ["1 2 3"] * 8, "max_tokens": 40, "temperature": 1.0, "seed": 3, "logprobs": 20,
                       "echo": True, "stream": True}).encode()
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # and never read
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [[(7 * i) % 29 + 1, (3 * i) % 29] for i in range(24)]

    def one(i: int) -> str:
        text = " ".join(map(str, prompts[i]))
        if i % 2:
            chunks = client.completions.create(model="megatrain", prompt=text, max_tokens=12, temperature=0,
                                               stream=True)
            return "".join(c.choices[0].text for c in chunks)
        return client.completions.create(model="megatrain", prompt=text, max_tokens=12, temperature=0).choices[0].text

    try:
        with ThreadPoolExecutor(max_workers=24) as pool:
            got = list(pool.map(one, range(24)))
        assert got == [expected_text(model, p, 12) for p in prompts]
        models = client.models.list()
        assert [m.id for m in models.data] == ["megatrain"]
    finally:
        stalled.close()
    # the stalled client is gone: its jobs were cancelled and the server still answers
    out = client.completions.create(model="megatrain", prompt="5 6", max_tokens=4, temperature=0)
    assert out.choices[0].text == expected_text(model, [5, 6], 4)


def test_chat_through_the_openai_client(tmp_path):
    from megatrain.data.tokenizers import TokenizerConfig
    from tests.unit.test_sft import OWN_TEMPLATE, write_sft_tokenizer

    folder = write_sft_tokenizer(tmp_path / "tok", chat_template=OWN_TEMPLATE)
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=folder))
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=32,
                               max_position_embeddings=64, init_method_std=0.3))
    model.init_weights(seed=2)
    srv = make_server(model_context(model.eval(), tok, ServerLimits(max_prompt_tokens=40, max_tokens_to_generate=8)),
                      "127.0.0.1", 0, quiet=True)
    srv.start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
        out = client.chat.completions.create(model="megatrain", messages=messages, max_tokens=5, temperature=0,
                                             n=2, logprobs=True, top_logprobs=3)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        new = generate(model, [ids], 5, eod=tok.eod)[0]
        text = tok.detokenize([t for t in new if t != tok.eod])
        assert [c.message.content for c in out.choices] == [text, text]
        assert all(len(t.top_logprobs) == 3 for t in out.choices[0].logprobs.content)
        streamed = client.chat.completions.create(model="megatrain", messages=messages, max_tokens=5, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
        chunks = list(streamed)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage.prompt_tokens == len(ids)
        with pytest.raises(openai.BadRequestError, match="does not take the field 'tools'"):
            client.chat.completions.create(model="megatrain", messages=messages, tools=[{
                "type": "function", "function": {"name": "f", "parameters": {}}}])
    finally:
        srv.shutdown()
        srv.server_close()
