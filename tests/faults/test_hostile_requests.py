"""Hostile request bodies against the real server command, over real HTTP on 127.0.0.1.

``tools/run_text_generation_server.py`` serves a tiny checkpoint in a subprocess whose log goes to a
file. Every malformed body (nested 100,000 deep, not UTF-8, not JSON, not an object, NaN, huge
numbers, lone surrogates, fields of every wrong type) and every bad ``Content-Length`` (absent,
negative, not a number, conflicting, huge, longer than the body, a body over the limit) is answered
with a 4xx and a one-line JSON ``message``: never a 500. The server keeps serving after each, and
its log holds no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import TrainState
from tests.unit.test_server import TOKENIZER, tiny_model

REPO = Path(__file__).resolve().parents[2]
LIMIT = 1 << 20  # the server's default --max-request-bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile_server")
    model = tiny_model()
    checkpointing.save_checkpoint(str(root / "ckpt"), TrainState(iteration=1), model, None, {},
                                  argparse.Namespace(**TOKENIZER), model.config)
    log = open(root / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "run_text_generation_server.py"), "--load",
                             str(root / "ckpt"), "--port", "0", "--device", "cpu", "--max-tokens-to-generate", "4",
                             "--request-body-timeout", "1"],
                            stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    try:
        line = proc.stdout.readline()
        assert "serving on http://127.0.0.1:" in line, line + (root / "server.log").read_text()
        yield int(line.rsplit(":", 1)[1].split()[0]), proc, root / "server.log"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def exchange(port: int, data: bytes, then_shutdown: bool = False, timeout: float = 30) -> tuple[int, bytes]:
    """Send raw bytes, read the answer until the server closes; (status, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            if then_shutdown:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered before taking the whole body; its answer is still readable
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), out[:300]
    return int(head.split()[1]), body


def request(port: int, body: bytes, method: str = "PUT", path: str = "/api", headers: str | None = None,
            **kw) -> tuple[int, bytes]:
    if headers is None:
        headers = f"Content-Length: {len(body)}\r\n"
    return exchange(port, f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n".encode()
                    + body, **kw)


def assert_refused(got: tuple[int, bytes], status: int | tuple[int, ...], fragment: str = "") -> str:
    code, body = got
    assert code in ((status,) if isinstance(status, int) else status), (code, body[:300])
    message = json.loads(body)["message"]
    assert isinstance(message, str) and "\n" not in message and fragment in message, message
    return message


def assert_healthy(port: int) -> None:
    code, body = request(port, b"", "GET", "/health", headers="")
    assert code == 200 and json.loads(body) == {"status": "ok"}


DEEP = 100_000
BODIES = {
    "nested_array": (b"[" * DEEP + b"]" * DEEP, "nested too deeply"),
    "nested_in_prompts": (b'{"prompts": ' + b"[" * DEEP + b"]" * DEEP + b"}", "nested too deeply"),
    "nested_objects": (b'{"a":' * DEEP + b"1" + b"}" * DEEP, "nested too deeply"),
    "not_utf8": ('{"prompts": ["é"]}'.encode("latin-1"), "not UTF-8"),
    "utf16": ('{"prompts": ["1"]}'.encode("utf-16"), "not UTF-8"),
    "not_json": (b"{prompts: 1", "not valid JSON"),
    "empty": (b"", "not valid JSON"),
    "truncated": (b'{"prompts": ["1 2"', "not valid JSON"),
    "list": (b'["1"]', "must be a JSON object"),
    "string": (b'"1 2"', "must be a JSON object"),
    "null": (b"null", "must be a JSON object"),
    "nan": (b'{"prompts": ["1"], "temperature": NaN}', "NaN is not a JSON value"),
    "infinity": (b'{"prompts": ["1"], "top_p": -Infinity}', "Infinity is not a JSON value"),
    "float_overflow": (b'{"prompts": ["1"], "temperature": 1e999}', "too large"),
    "long_integer": (b'{"prompts": ["1"], "tokens_to_generate": ' + b"7" * 5000 + b"}", "more than 4300 digits"),
    "lone_surrogate": (b'{"prompts": ["\\ud800 1"]}', "lone UTF-16 surrogate"),
    "surrogate_key": (b'{"\\udfff": 1, "prompts": ["1"]}', "lone UTF-16 surrogate"),
}


@pytest.mark.parametrize("name", list(BODIES))
def test_malformed_bodies_get_400(server, name):
    port, _, _ = server
    body, fragment = BODIES[name]
    for method, path in (("PUT", "/api"), ("POST", "/v1/completions")):
        assert_refused(request(port, body, method, path), 400, fragment)
    assert_healthy(port)


@pytest.mark.parametrize("headers, body, status, fragment", [
    ("", b'{"prompts": ["1"]}', 411, "Content-Length header is required"),
    ("Content-Length: -1\r\n", b"", 400, "non-negative integer"),
    ("Content-Length: +5\r\n", b'{"a":1}', 400, "non-negative integer"),
    ("Content-Length: 1_0\r\n", b'{"a": 1234}', 400, "non-negative integer"),
    ("Content-Length: ten\r\n", b"", 400, "non-negative integer"),
    ("Content-Length: \r\n", b"", 400, "non-negative integer"),
    ("Content-Length: 2\r\nContent-Length: 9\r\n", b"{}", 400, "conflicting"),
    ("Content-Length: 99999999999999999999999999999\r\n", b"{}", 413, "byte limit"),
    (f"Content-Length: {LIMIT + 1}\r\n", b"{" * 65536, 413, "byte limit"),
], ids=["absent", "negative", "plus_sign", "underscore", "word", "blank", "conflicting", "huge", "over_limit"])
def test_bad_content_length(server, headers, body, status, fragment):
    port, _, _ = server
    assert_refused(request(port, body, headers=headers), status, fragment)
    assert_healthy(port)


def test_body_over_the_limit_sent_in_full(server):
    port, _, _ = server
    body = json.dumps({"prompts": ["1 " * (LIMIT // 2)]}).encode()
    assert_refused(request(port, body), 413, "byte limit")
    assert_healthy(port)


def test_body_shorter_than_content_length(server):
    port, _, _ = server
    # The client ends its side: the server sees the body end early.
    assert_refused(request(port, b'{"prompts": ["1"]}', headers="Content-Length: 40\r\n", then_shutdown=True),
                   400, "ended after 18 of its 40 bytes")
    # The client keeps the connection open and sends nothing more: answered once the body timeout passes.
    start = time.monotonic()
    assert_refused(request(port, b'{"prompts": ["1"]}', headers="Content-Length: 40\r\n"), 408, "not received")
    assert time.monotonic() - start < 10
    assert_healthy(port)


WRONG_VALUES = [None, True, False, 0, -1, 1.5, 2**64, -(2**70), "", "x", [], [1], {}, {"a": [1]}]
FIELDS = {
    ("PUT", "/api"): ({"prompts": ["1 2"], "tokens_to_generate": 2},
                      ["prompts", "tokens_to_generate", "logprobs", "temperature", "top_k", "top_p",
                       "random_seed", "add_BOS", "stop_on_eol", "beam_width"]),
    ("POST", "/v1/completions"): ({"prompt": "1 2", "max_tokens": 2},
                                  ["prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed",
                                   "echo", "stream", "stream_options", "n", "best_of", "logprobs", "model"]),
}


def test_every_field_of_every_wrong_type(server):
    """Each field given each kind of value: 200 (when it is a valid value after all) or a 4xx, never 500."""
    port, _, _ = server
    seen = set()
    for (method, path), (base, fields) in FIELDS.items():
        for field in fields:
            for value in WRONG_VALUES:
                body = json.dumps({**base, field: value}).encode()
                code, answer = request(port, body, method, path)
                seen.add(code)
                assert code in (200, 400), (method, path, field, value, code, answer[:300])
                if code == 400:
                    assert_refused((code, answer), 400)
    assert seen == {200, 400}
    assert_healthy(port)


def test_the_server_log_holds_no_traceback(server):
    port, proc, log = server
    assert_refused(request(port, b"[" * DEEP), 400, "nested too deeply")
    # A client that goes away before its answer is written.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n[1,")
    time.sleep(0.3)
    # http.server's own refusals answer in JSON too.
    code, body = exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 200 + b"\r\n")
    assert code == 431 and json.loads(body)["message"]
    assert_healthy(port)
    assert proc.poll() is None, "the server must still be running"
    text = log.read_text()
    assert "Traceback" not in text and "Exception" not in text, text[-3000:]
    assert '" 500 ' not in text, text[-3000:]
