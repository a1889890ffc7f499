"""The HTTP front end in its own process (megatrain.inference.frontend_process): the same answers as
the one-process server over real HTTP and the real openai client, streaming, scoring calls, 503 when
the engine is full, 400 for a job the engine refuses, and a client that leaves mid-stream."""

from __future__ import annotations

import http.client
import json

import pytest

from megatrain.data.tokenizers import build_tokenizer
from megatrain.inference.engine.api import GenerateJob, Sampling
from megatrain.inference.frontend_process import FrontendProcess, job_from_json, job_to_json
from megatrain.inference.server import ServerLimits, make_server, model_context
from tests.unit.test_server import TOKENIZER, forward_logprobs, greedy, tiny_model

openai = pytest.importorskip("openai")

LIMITS = dict(max_prompt_tokens=12, max_tokens_to_generate=8, max_batch_size=8, max_request_bytes=2000)


@pytest.fixture(scope="module")
def servers():
    model = tiny_model()
    tokenizer = build_tokenizer(TOKENIZER)
    remote = FrontendProcess(model_context(model, tokenizer, ServerLimits(**LIMITS), max_requests=2), TOKENIZER,
                             "127.0.0.1", 0, quiet=True)
    remote.start()
    local = make_server(model_context(model, tokenizer, ServerLimits(**LIMITS), max_requests=2), "127.0.0.1", 0,
                        quiet=True)
    local.start()
    yield remote, local, model
    for srv in (remote, local):
        srv.shutdown()
        srv.server_close()


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    return resp.status, out


def test_jobs_cross_the_pipe_unchanged():
    job = GenerateJob([1, 2, 3], 5, Sampling(temperature=0.5, top_k=3, seed=7, logit_bias={4: -2.5}),
                      eod=9, stop_token_sequences=[[1, 2]], top_logprobs=2)
    assert job_from_json(json.loads(json.dumps(job_to_json(job)))) == job


def test_completions_equal_the_one_process_server(servers):
    remote, local, model = servers
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{remote.port}/v1", api_key="x", max_retries=0)
    out = client.completions.create(model="megatrain", prompt=[[3, 4, 5]], max_tokens=6, temperature=0, logprobs=2)
    assert [int(t) for t in out.choices[0].text.split()] == greedy(model, [3, 4, 5], 6)
    body = {"prompt": [[3, 4, 5], [7]], "max_tokens": 6, "temperature": 0, "logprobs": 1, "n": 2}
    (s1, a), (s2, b) = post(remote.port, "/v1/completions", body), post(local.port, "/v1/completions", body)
    assert s1 == s2 == 200
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    for x, y in zip(a["choices"], b["choices"]):  # fp32; the rows may be batched differently in the two servers
        assert x["logprobs"]["token_logprobs"] == pytest.approx(y["logprobs"]["token_logprobs"], rel=1e-5, abs=1e-6)
    assert a["usage"] == b["usage"]


def test_streaming_and_scoring_calls(servers):
    remote, _, model = servers
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{remote.port}/v1", api_key="x", max_retries=0)
    chunks = list(client.completions.create(model="megatrain", prompt=[[1, 2]], max_tokens=5, temperature=0,
                                            stream=True))
    assert [int(t) for t in "".join(c.choices[0].text for c in chunks if c.choices).split()] == greedy(model, [1, 2], 5)
    # echo + max_tokens 0: a registered scoring call run by the engine in the parent process
    status, out = post(remote.port, "/v1/completions", {"prompt": [[1, 2, 3, 4]], "max_tokens": 0, "echo": True,
                                                        "logprobs": 1, "temperature": 0})
    assert status == 200, out
    assert out["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
        forward_logprobs(model, [1, 2, 3, 4]), abs=1e-5)


def test_refusals_cross_the_pipe(servers):
    remote, local, _ = servers
    body = {"prompt": [[1, 2, 3]], "max_tokens": 4, "temperature": 0, "logit_bias": {"999": 1.0}}
    (s1, a), (s2, b) = post(remote.port, "/v1/completions", body), post(local.port, "/v1/completions", body)
    assert s1 == s2 and s1 == 400 and a == b


def test_a_client_leaving_mid_stream_frees_its_slot(servers):
    remote, _, model = servers
    for _ in range(3):  # more streams than the engine's 2 slots, each dropped after its first chunk
        conn = http.client.HTTPConnection("127.0.0.1", remote.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": [[5, 6]], "max_tokens": 8, "temperature": 0, "stream": True}).encode(),
            headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        resp.fp.readline()
        conn.close()
    status, out = post(remote.port, "/v1/completions", {"prompt": [[5, 6]], "max_tokens": 8, "temperature": 0})
    assert status == 200 and [int(t) for t in out["choices"][0]["text"].split()] == greedy(model, [5, 6], 8)


def test_the_engine_process_gone_is_a_clear_error_not_a_broken_pipe():
    """The model's process ended (its end of the pipe closed): a submission gets one RuntimeError,
    a cancel of a running handle is nothing to do, and nothing raises BrokenPipeError."""
    import multiprocessing

    from megatrain.inference.engine.api import GenerateJob, Sampling
    from megatrain.inference.frontend_process import RemoteEngine, _RemoteHandle

    ours, theirs = multiprocessing.Pipe()
    engine = RemoteEngine(ours, max_sequence_length=32)
    theirs.close()
    engine._reader.join(5)
    handle = _RemoteHandle(engine, 0)
    handle.cancel()
    with pytest.raises(RuntimeError, match="gone|closed"):
        engine.submit(GenerateJob([1, 2], 4, Sampling(greedy=True)), lambda event: None)
    engine._closed = False  # a send on the broken pipe itself
    with pytest.raises(RuntimeError, match="gone"):
        engine._send({"op": "cancel", "id": 1})
