"""HTTP text-generation server: Megatron-LM's ``PUT /api`` and an OpenAI-style ``POST /v1/completions``.

Standard library only (``http.server.ThreadingHTTPServer``): each request runs in its own thread,
requests are parsed and validated concurrently, and one lock serialises the model. Every bad
request (unparsable JSON, wrong types, empty or over-long prompts, limits) is answered with a 4xx
and ``{"message": ...}``; an unexpected failure with a 500; the server keeps running.

``PUT /api`` (Megatron-LM's fields)::

    {"prompts": ["..."], "tokens_to_generate": 64, "temperature": 1.0, "top_k": 0, "top_p": 0.0,
     "random_seed": 1234, "logprobs": false, "add_BOS": false}
    -> {"text": [prompt + completion, ...], "segments": [[token strings], ...], "logprobs": [[...], ...]}

As in Megatron, the default is sampling at temperature 1; ``top_k: 1`` is greedy. An encoder-decoder
checkpoint (T5) takes the prompts as encoder inputs; ``text`` and ``segments`` are then its decoder's
output and ``logprobs`` those of every generated token.

``POST /v1/completions``::

    {"prompt": "..." | ["..."], "max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
     "stop": "..." | ["..."], "seed": 1, "echo": false}
    -> {"id", "object": "text_completion", "created", "model", "choices": [{"text", "index",
        "logprobs": null, "finish_reason": "stop" | "length"}], "usage": {...}}

``temperature: 0`` is greedy. With ``"stream": true`` the answer is server-sent events
(``text/event-stream``): ``data: {... "choices": [{"text": <new text>, "index", "finish_reason"}]}``
chunks as tokens are generated, the last chunk of each choice with its finish reason, a usage
chunk with ``"stream_options": {"include_usage": true}``, then ``data: [DONE]``.
``GET /health`` answers ``{"status": "ok"}``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import torch
from torch import nn

from megatrain.inference.seq2seq import (decoder_start_token, is_encoder_decoder, sequence_logprobs,
                                         tokenize_with_sentinels)
from megatrain.inference.text_generation import Completion, SamplingParams, complete
from megatrain.json_input import parse_json


class RequestError(Exception):
    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.status = int(status)
        self.message = message


@dataclass
class ServerLimits:
    max_prompt_tokens: int = 2048
    max_tokens_to_generate: int = 1024
    max_batch_size: int = 16
    max_request_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # a body not fully received in this time is answered 408


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_SEED_LIMIT = 1 << 63  # torch generators take 64-bit seeds


def parse_request_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body; anything else raises :class:`RequestError` (400) with one line."""
    try:
        req = parse_json(raw, strict=True)
    except ValueError as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise RequestError(f"the body must be a JSON object, not {type(req).__name__}")
    return req


class TextGenerationService:
    """Validates requests, runs the model under a lock, formats the answers."""

    def __init__(self, model: nn.Module, tokenizer, limits: ServerLimits | None = None, model_name: str = "megatrain"):
        self.model = model
        self.tokenizer = tokenizer
        self.limits = limits or ServerLimits()
        self.model_name = model_name
        self.lock = threading.Lock()
        config = getattr(model, "config", None)
        self.max_positions = (config.max_position_embeddings
                              if config is not None and config.position_embedding_type == "learned_absolute" else None)
        self.seq2seq = is_encoder_decoder(model)  # T5: prompts are encoder inputs, answers decoder outputs

    # ---- shared checks ------------------------------------------------------------------------
    def _prompts(self, value: Any, name: str) -> list[str]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value:
            raise RequestError(f"{name} must be a non-empty list of strings")
        if len(value) > self.limits.max_batch_size:
            raise RequestError(f"at most {self.limits.max_batch_size} prompts per request, got {len(value)}")
        for i, p in enumerate(value):
            if not isinstance(p, str):
                raise RequestError(f"{name}[{i}] must be a string")
            if not p:
                raise RequestError(f"{name}[{i}] is empty")
        return value

    def _tokenize(self, prompts: list[str], tokens_to_generate: int, add_bos: bool = False) -> list[list[int]]:
        out = []
        for i, p in enumerate(prompts):
            try:
                ids = tokenize_with_sentinels(self.tokenizer, p) if self.seq2seq else self.tokenizer.tokenize(p)
            except ValueError as e:
                raise RequestError(f"prompt {i} cannot be tokenized: {e}") from None
            if add_bos and self.tokenizer.bos is not None:
                ids = [self.tokenizer.bos, *ids]
            if not ids:
                raise RequestError(f"prompt {i} has no tokens")
            if len(ids) > self.limits.max_prompt_tokens:
                raise RequestError(f"prompt {i} has {len(ids)} tokens; the limit is {self.limits.max_prompt_tokens}")
            if self.max_positions is not None and self.seq2seq:  # the encoder's and the decoder's positions
                if max(len(ids), tokens_to_generate) > self.max_positions:
                    raise RequestError(f"prompt {i} ({len(ids)} tokens) or its {tokens_to_generate} new tokens exceed "
                                       f"the model's {self.max_positions} positions")
            elif self.max_positions is not None and len(ids) + tokens_to_generate - 1 > self.max_positions:
                raise RequestError(f"prompt {i} ({len(ids)} tokens) plus {tokens_to_generate} new tokens exceeds "
                                   f"the model's {self.max_positions} positions")
            out.append(ids)
        return out

    def _count(self, value: Any, name: str) -> int:
        if not _is_int(value) or value < 0:
            raise RequestError(f"{name} must be a non-negative integer")
        if value > self.limits.max_tokens_to_generate:
            raise RequestError(f"{name} is {value}; the limit is {self.limits.max_tokens_to_generate}")
        return value

    def _run(self, prompts: list[str], ids: list[list[int]], params: SamplingParams,
             on_tokens: Callable[[int, list[int | None]], None] | None = None) -> list[Completion]:
        with self.lock:
            try:
                return complete(self.model, self.tokenizer, prompts, params, prompt_ids=ids, on_tokens=on_tokens)
            except ValueError as e:
                raise RequestError(str(e)) from None

    def _logprobs(self, sequences: list[list[int]], encoder_ids: list[list[int]] | None = None) -> list[list[float]]:
        """Log-probability of every token after the first of each sequence, under the model; for an
        encoder-decoder of every token of each decoder output given its encoder input."""
        out = []
        device = next(self.model.parameters()).device
        if encoder_ids is not None:
            start = decoder_start_token(self.tokenizer)
            with self.lock:
                return [sequence_logprobs(self.model, enc, seq, start, self.tokenizer.vocab_size)
                        for enc, seq in zip(encoder_ids, sequences)]
        with self.lock, torch.no_grad():
            for seq in sequences:
                if len(seq) < 2:
                    out.append([])
                    continue
                tokens = torch.tensor([seq], device=device)
                logits = self.model(tokens[:, :-1]).float().log_softmax(-1)
                out.append(logits[0].gather(-1, tokens[0, 1:, None])[:, 0].tolist())
        return out

    # ---- Megatron PUT /api ----------------------------------------------------------------------
    def megatron_api(self, req: dict[str, Any]) -> dict[str, Any]:
        if "prompts" not in req:
            raise RequestError("prompts argument required")
        prompts = self._prompts(req["prompts"], "prompts")
        default = min(64, self.limits.max_tokens_to_generate)
        n = self._count(req.get("tokens_to_generate", default), "tokens_to_generate")
        logprobs = req.get("logprobs", False)
        if not isinstance(logprobs, bool):
            raise RequestError("logprobs must be a boolean value")
        if n == 0 and not logprobs:
            raise RequestError("tokens_to_generate=0 implies logprobs should be True")
        temperature = req.get("temperature", 1.0)
        if not _is_number(temperature) or not 0.0 < temperature <= 100.0:
            raise RequestError("temperature must be a positive number less than or equal to 100.0")
        top_k = req.get("top_k", 0)
        if not _is_int(top_k) or not 0 <= top_k <= 1000:
            raise RequestError("top_k must be an integer equal to or greater than 0 and less than or equal to 1000")
        top_p = req.get("top_p", 0.0)
        if not _is_number(top_p) or not 0.0 <= top_p <= 1.0:
            raise RequestError("top_p must be a number between 0 and 1")
        if top_p > 0.0 and top_k > 0:
            raise RequestError("cannot set both top-k and top-p samplings.")
        seed = req.get("random_seed", None)
        if seed is not None and (not _is_int(seed) or not 0 <= seed < _SEED_LIMIT):
            raise RequestError("random_seed must be a non-negative integer below 2**63")
        add_bos = req.get("add_BOS", False)
        if not isinstance(add_bos, bool):
            raise RequestError("add_BOS must be a boolean value")
        for flag in ("stop_on_eol", "stop_on_double_eol", "prevent_newline_after_colon"):
            if req.get(flag, False) not in (False, None):
                raise RequestError(f"{flag} is not supported by this server")
        if req.get("beam_width") not in (None, 1):
            raise RequestError("beam search (beam_width) is not supported by this server")
        ids = self._tokenize(prompts, n, add_bos)
        params = SamplingParams(n, greedy=top_k == 1, temperature=float(temperature),
                                top_k=0 if top_k == 1 else top_k, top_p=float(top_p), seed=seed)
        if self.seq2seq and n == 0:
            raise RequestError("tokens_to_generate must be positive for an encoder-decoder model (its output is "
                               "what the decoder generates)")
        completions = self._run(prompts, ids, params)
        # an encoder-decoder answers with its decoder's output, not a continuation of the prompt
        full = [c.tokens if self.seq2seq else c.prompt_tokens + c.tokens for c in completions]
        response: dict[str, Any] = {
            "text": [self.tokenizer.detokenize(seq) for seq in full],
            "segments": [[self.tokenizer.detokenize([t]) for t in seq] for seq in full],
        }
        if logprobs:
            response["logprobs"] = self._logprobs(full, ids if self.seq2seq else None)
        return response

    # ---- OpenAI POST /v1/completions ------------------------------------------------------------
    def _completion_request(self, req: dict[str, Any]) -> _CompletionRequest:
        """Validate an OpenAI completions request (before anything is generated or sent)."""
        if "prompt" not in req:
            raise RequestError("prompt is required")
        prompts = self._prompts(req["prompt"], "prompt")
        n = self._count(req.get("max_tokens", min(16, self.limits.max_tokens_to_generate)), "max_tokens")
        temperature = req.get("temperature", 1.0)
        if not _is_number(temperature) or not 0.0 <= temperature <= 100.0:
            raise RequestError("temperature must be a number between 0 and 100")
        top_p = req.get("top_p", 1.0)
        if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
            raise RequestError("top_p must be a number in (0, 1]")
        top_k = req.get("top_k", 0)
        if not _is_int(top_k) or top_k < 0:
            raise RequestError("top_k must be a non-negative integer")
        stop = req.get("stop", None)
        if isinstance(stop, str):
            stop = [stop]
        if stop is None:
            stop = []
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise RequestError("stop must be a non-empty string or a list of up to 4 non-empty strings")
        seed = req.get("seed", None)
        if seed is not None and (not _is_int(seed) or not -_SEED_LIMIT <= seed < _SEED_LIMIT):
            raise RequestError("seed must be an integer from -2**63 to 2**63-1")
        echo = req.get("echo", False)
        if not isinstance(echo, bool):
            raise RequestError("echo must be a boolean")
        stream = req.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be a boolean")
        options = req.get("stream_options", None)
        if options is not None and (not isinstance(options, dict)
                                    or not isinstance(options.get("include_usage", False), bool)):
            raise RequestError("stream_options must be an object like {\"include_usage\": true}")
        if req.get("n", 1) != 1 or req.get("best_of", 1) != 1:
            raise RequestError("only n = 1 (and best_of = 1) is supported")
        if req.get("logprobs") not in (None, 0, False):
            raise RequestError("logprobs are not supported on /v1/completions; use PUT /api with \"logprobs\": true")
        greedy = temperature == 0.0
        ids = self._tokenize(prompts, n)
        params = SamplingParams(n, greedy=greedy, temperature=1.0 if greedy else float(temperature),
                                top_k=0 if greedy else top_k, top_p=0.0 if greedy or top_p == 1.0 else float(top_p),
                                seed=seed, stop=stop)
        model = req.get("model") if isinstance(req.get("model"), str) else self.model_name
        return _CompletionRequest(prompts, ids, params, echo, model, stream,
                                  bool((options or {}).get("include_usage", False)))

    @staticmethod
    def _usage(completions: list[Completion]) -> dict[str, int]:
        prompt_tokens = sum(len(c.prompt_tokens) for c in completions)
        completion_tokens = sum(len(c.tokens) for c in completions)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def openai_completions(self, req: dict[str, Any]) -> dict[str, Any]:
        r = self._completion_request(req)
        completions = self._run(r.prompts, r.ids, r.params)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": r.model,
            "choices": [{"text": (c.prompt if r.echo else "") + c.text, "index": i, "logprobs": None,
                         "finish_reason": c.finish_reason} for i, c in enumerate(completions)],
            "usage": self._usage(completions),
        }

    def stream_completions(self, req: dict[str, Any], send: Callable[[dict[str, Any] | str], None]) -> None:
        """``"stream": true``: server-sent events, one chunk of new text per choice as it is generated.

        The chunks of a choice add up to the text the same request gives without streaming: text is
        sent only once its tokens decode to whole characters, and text that could still become the
        start of a stop string is held back until it cannot. The last chunk of a choice carries its
        ``finish_reason``; with ``stream_options.include_usage`` a final chunk carries the usage;
        then ``[DONE]``.
        """
        r = self._completion_request(req)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": r.model}

        def chunk(index: int, text: str, finish_reason: str | None = None) -> None:
            send({**head, "choices": [{"text": text, "index": index, "logprobs": None,
                                       "finish_reason": finish_reason}]})

        texts = [_StreamedText(self.tokenizer, r.params.stop) for _ in r.prompts]
        if r.echo:
            for i, prompt in enumerate(r.prompts):
                chunk(i, prompt)

        def on_tokens(first: int, tokens: list[int | None]) -> None:
            for j, token in enumerate(tokens):
                if token is not None and token != self.tokenizer.eod:
                    delta = texts[first + j].add(token)
                    if delta:
                        chunk(first + j, delta)

        completions = self._run(r.prompts, r.ids, r.params, on_tokens)
        for i, c in enumerate(completions):
            chunk(i, texts[i].rest(c.text), c.finish_reason)
        if r.include_usage:
            send({**head, "choices": [], "usage": self._usage(completions)})
        send("[DONE]")


@dataclass
class _CompletionRequest:
    prompts: list[str]
    ids: list[list[int]]
    params: SamplingParams
    echo: bool
    model: str
    stream: bool
    include_usage: bool


class _StreamedText:
    """One choice's generated text while it streams: what has been sent, and what may be sent next."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """Take one generated token; return the text that can be sent now ("" if none)."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        text = self.tokenizer.detokenize(self.tokens)
        cuts = [text.index(s) for s in self.stops if s in text]
        if cuts:  # the completion ends before its first stop string
            self.stopped = True
            safe = text[:min(cuts)]
        else:
            safe = text.rstrip("\ufffd")  # a character whose bytes are not all generated yet
            held = max((k for s in self.stops for k in range(1, len(s)) if safe.endswith(s[:k])), default=0)
            safe = safe[:len(safe) - held]
        if not safe.startswith(self.sent):
            return ""  # decoding changed earlier text: wait for the final text
        delta, self.sent = safe[len(self.sent):], max(safe, self.sent, key=len)
        return delta

    def rest(self, final: str) -> str:
        """What is left to send of the finished choice's text."""
        return final[len(self.sent):] if final.startswith(self.sent) else ""


ROUTES = {("PUT", "/api"): "megatron_api", ("POST", "/api"): "megatron_api",
          ("POST", "/v1/completions"): "openai_completions"}


class _Handler(BaseHTTPRequestHandler):
    service: TextGenerationService  # set on the subclass made by make_server
    protocol_version = "HTTP/1.1"
    quiet = False

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if not self.quiet:
            super().log_message(format, *args)

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client went away (or stopped reading): nothing left to answer
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (bad request line, headers too long...) as one-line JSON too."""
        self.close_connection = True
        try:
            text = message or HTTPStatus(code).phrase
        except ValueError:  # a code http.HTTPStatus does not list
            text = "error"
        self.log_error("code %d, message %s", code, text)
        self._send(code, {"message": " ".join(str(text).split())})

    def _handle(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        try:
            if method == "GET" and path == "/health":
                self._send(200, {"status": "ok"})
                return
            route = ROUTES.get((method, path))
            if route is None:
                known = any(p == path for _, p in ROUTES)
                raise RequestError(f"{method} {path} is not served" + ("" if known else
                                   "; endpoints: PUT /api, POST /v1/completions, GET /health"),
                                   HTTPStatus.METHOD_NOT_ALLOWED if known else HTTPStatus.NOT_FOUND)
            req = self._read_json()
            if route == "openai_completions" and req.get("stream") is True:
                self._stream(req)
                return
            self._send(200, getattr(self.service, route)(req))
        except RequestError as e:
            self.close_connection = True
            self._send(e.status, {"message": e.message})
        except Exception as e:  # noqa: BLE001 - the server must answer and keep running
            self.close_connection = True
            self._send(500, {"message": " ".join(f"internal error: {type(e).__name__}: {e}".split())})

    def _stream(self, req: dict[str, Any]) -> None:
        """Answer with server-sent events; a bad request still gets its 4xx before any event."""
        started = False
        self.close_connection = True  # the stream's end is the connection's end (no Content-Length)

        def send(event: dict[str, Any] | str) -> None:
            nonlocal started
            if not started:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                started = True
            data = event if isinstance(event, str) else json.dumps(event)
            self.wfile.write(f"data: {data}\n\n".encode("utf-8"))
            self.wfile.flush()

        try:
            self.service.stream_completions(req, send)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away; generation stopped with the failed write
        except Exception as e:  # noqa: BLE001
            if not started:
                raise
            send({"error": {"message": f"{type(e).__name__}: {e}"}})

    def _read_json(self) -> dict[str, Any]:
        """Read exactly Content-Length bytes (within the limits) and parse them (:func:`parse_request_body`)."""
        limits = self.service.limits
        values = {v.strip() for v in self.headers.get_all("Content-Length", [])}
        if not values:
            raise RequestError("a Content-Length header is required", HTTPStatus.LENGTH_REQUIRED)
        if len(values) > 1:
            raise RequestError("conflicting Content-Length headers")
        (length_header,) = values
        if not length_header.isascii() or not length_header.isdigit():
            raise RequestError(f"Content-Length must be a non-negative integer, got {length_header[:40]!r}")
        if len(length_header) > 18 or int(length_header) > limits.max_request_bytes:
            raise RequestError(f"request body of {length_header[:40]} bytes exceeds the {limits.max_request_bytes} "
                               "byte limit", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        length = int(length_header)
        self.connection.settimeout(limits.body_timeout_s)
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            raise RequestError(f"the body was not received within {limits.body_timeout_s:g} s "
                               f"(Content-Length {length})", HTTPStatus.REQUEST_TIMEOUT) from None
        finally:
            self.connection.settimeout(None)
        if len(raw) != length:
            raise RequestError(f"the body ended after {len(raw)} of its {length} bytes (Content-Length)")
        return parse_request_body(raw)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._handle("GET")

    def do_PUT(self) -> None:  # noqa: N802
        self._handle("PUT")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")


def make_server(service: TextGenerationService, host: str = "127.0.0.1", port: int = 5000,
                quiet: bool = False) -> ThreadingHTTPServer:
    """A ready (bound, not yet serving) threaded HTTP server for ``service``; port 0 picks a free one."""
    handler = type("TextGenerationHandler", (_Handler,), {"service": service, "quiet": quiet})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
