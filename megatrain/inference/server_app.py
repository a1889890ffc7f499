"""The HTTP layer of the text-generation server: a FastAPI app served by uvicorn.

- Bodies: a ``Content-Length`` (or chunked transfer encoding) is required (411), at most
  ``max_request_bytes`` (413), received in full within ``body_timeout_s`` (408); then parsed as one
  JSON object (400). Every refusal is one line of JSON, ``{"message": ...}``; a refusal sent before the
  body was read in full carries ``Connection: close`` (the rest of the connection cannot be trusted),
  any other leaves the connection open for the next request. An unexpected failure is a 500.
- At most ``max_pending_requests`` requests are answered at once; more get 503 with ``Retry-After``,
  as does a request the engine has no room for (``EngineFull``). The listen backlog is 2048.
- Streams (server-sent events) are fed from each request's own queue: a client that stops reading
  holds only its own stream, and one that disconnects cancels its jobs (so does a client that leaves
  while waiting for a plain answer).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

import anyio
import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from megatrain.inference.chat import chat_completions, parse_chat, stream_chat
from megatrain.inference.megatron_api import megatron_generate
from megatrain.inference.openai_api import completions, models, parse_completion, stream_completions
from megatrain.inference.server_common import RequestError, ServerContext, parse_request_body

ENDPOINTS = "PUT /api, POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health"
LISTEN_BACKLOG = 2048
MAX_HEADERS = 100
CLOSE = {"Connection": "close"}
BODY_EOF = "megatrain.body_eof"  # set in the scope when the client ended its side before the body did


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"message": " ".join(str(message).split())}, status_code=status, headers=headers)


async def read_json(request: Request, ctx: ServerContext) -> dict[str, Any]:
    """The request's JSON object, read within the limits (see the module docstring)."""
    limits = ctx.limits
    lengths = {v.strip() for v in request.headers.getlist("content-length")}
    chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
    if not lengths and not chunked:
        raise RequestError("a Content-Length header is required", HTTPStatus.LENGTH_REQUIRED, CLOSE)
    if len(lengths) > 1:
        raise RequestError("conflicting Content-Length headers", headers=CLOSE)
    expected = None
    if lengths:
        (header,) = lengths
        if not header.isascii() or not header.isdigit():
            raise RequestError(f"Content-Length must be a non-negative integer, got {header[:40]!r}", headers=CLOSE)
        if len(header) > 18 or int(header) > limits.max_request_bytes:
            raise RequestError(f"request body of {header[:40]} bytes exceeds the {limits.max_request_bytes} byte limit",
                               HTTPStatus.REQUEST_ENTITY_TOO_LARGE, CLOSE)
        expected = int(header)
    body = bytearray()
    try:
        with anyio.fail_after(limits.body_timeout_s):
            while True:  # raw messages: the end of the client's side arrives as an empty one
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect()
                body += message.get("body", b"")
                if len(body) > limits.max_request_bytes:
                    raise RequestError(f"request body exceeds the {limits.max_request_bytes} byte limit",
                                       HTTPStatus.REQUEST_ENTITY_TOO_LARGE, CLOSE)
                if not message.get("more_body", False) or request.scope.get(BODY_EOF):
                    break
    except TimeoutError:
        raise RequestError(f"the body was not received within {limits.body_timeout_s:g} s"
                           + (f" (Content-Length {expected})" if expected is not None else ""),
                           HTTPStatus.REQUEST_TIMEOUT, CLOSE) from None
    if expected is not None and len(body) != expected:
        raise RequestError(f"the body ended after {len(body)} of its {expected} bytes (Content-Length)", headers=CLOSE)
    return parse_request_body(bytes(body))


async def until_answered(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result; cancelled (its jobs with it) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(request.receive())  # the body is read: the next message is a disconnect
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            raise ClientDisconnect()
        return task.result()
    finally:
        watcher.cancel()
        task.cancel()


class EventStream(StreamingResponse):
    """Server-sent events that stop (and close their generator: its jobs are cancelled) as soon as the
    client disconnects, whatever the ASGI version."""

    def __init__(self, events: AsyncIterator[dict[str, Any] | str]) -> None:
        async def encoded() -> AsyncIterator[bytes]:
            try:
                async for event in events:
                    yield f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
            except RequestError as e:  # after the first event the status is sent: the error is an event
                yield f"data: {json.dumps({'error': {'message': e.message}})}\n\n".encode()
            finally:
                await events.aclose()  # type: ignore[attr-defined]

        super().__init__(encoded(), headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                             "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _first_then_rest(events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Start ``events`` now (a request error before its first event is still a 4xx), then stream it."""
    first = await events.__anext__()

    async def rest() -> AsyncIterator[Any]:
        try:
            yield first
            async for e in events:
                yield e
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    return rest()


class JSONRefusalProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with its own refusals (a request h11 cannot parse) as one-line JSON,
    and a client that ends its side in the middle of its body answered (400) rather than dropped.
    ``max_request_bytes``: set on the subclass each server makes (a Content-Length too long for h11 to
    parse is over it: 413)."""

    max_request_bytes = 1 << 20

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refusal: h11.RemoteProtocolError | None = None
        self._recent = b""  # the last bytes received, to name a refused header
        next_event = self.conn.next_event

        def remembering_next_event() -> Any:
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._refusal = e
                raise

        self.conn.next_event = remembering_next_event  # type: ignore[method-assign]

    def data_received(self, data: bytes) -> None:
        self._recent = (self._recent + data)[-65536:]
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        reason = str(self._refusal) if self._refusal is not None else msg
        status = getattr(self._refusal, "error_status_hint", 400) or 400
        message = f"invalid HTTP request: {reason}"
        if "bad Content-Length" in reason:
            values = re.findall(rb"(?im)^content-length:[ \t]*([^\r\n]*)", self._recent)
            value = values[-1].strip().decode("latin-1") if values else ""
            message = f"Content-Length must be a non-negative integer, got {value[:40]!r}"
            if value.isascii() and value.isdigit():
                status, message = 413, (f"request body of {value[:40]} bytes exceeds the {self.max_request_bytes} "
                                        "byte limit")
        body = json.dumps({"message": message}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def eof_received(self) -> bool | None:
        """The client ended its side: in the middle of a body, keep ours open to answer 400; otherwise
        it has gone (the connection closes, its jobs are cancelled)."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.more_body or cycle.response_started:
            return None
        cycle.keep_alive = False  # answer, then close
        cycle.scope[BODY_EOF] = True  # type: ignore[literal-required]
        cycle.message_event.set()
        return True


class RequestLimit:
    """ASGI middleware: at most ``limit`` HTTP requests at once (``GET /health`` not counted)."""

    def __init__(self, app: Callable, limit: int) -> None:
        self.app, self.limit, self.active = app, limit, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and len(scope["headers"]) > MAX_HEADERS:
            response = _error(431, f"more than {MAX_HEADERS} header lines", CLOSE)
            return await response(scope, receive, send)
        if scope["type"] != "http" or scope.get("path") == "/health":
            return await self.app(scope, receive, send)
        if self.active >= self.limit:
            response = _error(503, f"the server is answering {self.active} requests, its limit; retry later",
                              {"Retry-After": "1", **CLOSE})
            return await response(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


def build_app(ctx: ServerContext) -> Any:
    """The ASGI app answering every endpoint for ``ctx``."""
    app = FastAPI(title="megatrain text generation", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestError)
    async def request_error(_: Request, e: RequestError) -> JSONResponse:
        return _error(e.status, e.message, e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        if e.status_code in (404, 405):
            extra = "" if e.status_code == 405 else f"; endpoints: {ENDPOINTS}"
            return _error(e.status_code, f"{request.method} {path} is not served{extra}")
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody reads it: the client left (its jobs were cancelled)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        return _error(500, f"internal error: {type(e).__name__}: {e}", CLOSE)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return models(ctx)

    @app.api_route("/api", methods=["PUT", "POST"])
    async def megatron(request: Request) -> Any:
        req = await read_json(request, ctx)
        return JSONResponse(await until_answered(request, megatron_generate(ctx, req)))

    @app.post("/v1/completions")
    async def openai_completions(request: Request) -> Any:
        req = await read_json(request, ctx)
        if req.get("stream") is True:
            r = await run_in_threadpool(parse_completion, ctx, req)
            return EventStream(await _first_then_rest(stream_completions(ctx, r)))
        return JSONResponse(await until_answered(request, completions(ctx, req)))

    @app.post("/v1/chat/completions")
    async def openai_chat(request: Request) -> Any:
        req = await read_json(request, ctx)
        if req.get("stream") is True:
            r = await run_in_threadpool(parse_chat, ctx, req)
            return EventStream(await _first_then_rest(stream_chat(ctx, r)))
        return JSONResponse(await until_answered(request, chat_completions(ctx, req)))

    return RequestLimit(app, ctx.limits.max_pending_requests)


class TextGenerationServer:
    """uvicorn serving :func:`build_app` on a socket bound at construction (port 0: a free one)."""

    def __init__(self, ctx: ServerContext, host: str = "127.0.0.1", port: int = 5000, quiet: bool = False,
                 sock: socket.socket | None = None) -> None:
        """``sock``: a listening socket bound elsewhere (the front end's process gets its parent's)."""
        self.ctx = ctx
        if sock is None:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        self.socket = sock
        self.server_address = self.socket.getsockname()[:2]
        protocol = type("ServerProtocol", (JSONRefusalProtocol,), {"max_request_bytes": ctx.limits.max_request_bytes})
        config = uvicorn.Config(build_app(ctx), http=protocol, backlog=LISTEN_BACKLOG, log_level="warning" if quiet else "info",
                                access_log=not quiet, lifespan="off", timeout_keep_alive=30,
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._stopped.set()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def serve_forever(self) -> None:
        """Serve until interrupted (SIGINT/SIGTERM when called from the main thread) or :meth:`shutdown`."""
        self._stopped.clear()
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def start(self) -> None:
        """Serve from a background thread (returns once it accepts connections)."""
        self._thread = threading.Thread(target=self.serve_forever, name="http-server", daemon=True)
        self._thread.start()
        while not self.server.started and self._thread.is_alive():
            self._thread.join(0.02)

    def shutdown(self) -> None:
        """Stop serving (from another thread) and wait for :meth:`serve_forever` to return."""
        self.server.should_exit = True
        if self.server.started or (self._thread is not None and self._thread.is_alive()):
            self._stopped.wait(30)

    def server_close(self) -> None:
        """Close the listening socket and the engine."""
        self.socket.close()
        self.ctx.engine.close()
