"""The HTTP front end in its own process, the engine in the model's: no interpreter lock shared.

In one process the engine thread and the server's event loop share Python's interpreter lock, and
every PyTorch operation of an eager forward hands it over and waits to take it back: under many
streaming clients a prefill forward runs several times slower than alone (benchmarks/RESULTS.md,
"Serving engine: steps run ahead, the load benchmark, prefill"). Here the FastAPI/uvicorn app runs in
a child process (``multiprocessing`` spawn) on the socket the parent bound, and reaches the engine
through a pipe:

- the child's :class:`RemoteEngine` is the :class:`~megatrain.inference.engine.api.Engine` its
  endpoints use: ``submit`` sends the job and waits for the engine's answer (so ``EngineFull`` and a
  job's ``ValueError`` reach the endpoint as in one process), ``call`` returns a future, a handle's
  ``cancel`` sends a cancel;
- the parent's :class:`EngineHost` runs them on the real engine; token events go into a queue that a
  sender thread drains into one message per batch (the engine thread only appends).

Messages are JSON (never pickles): jobs, events, registered calls' payloads and results (which must be
plain JSON). The tokenizer is built in the child from its build arguments. Vision-language models are
served in one process (their image requests carry tensors through a registered call).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import multiprocessing
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from megatrain.inference.engine.api import EngineFull, GenerateJob, Sampling, TokenEvent

log = logging.getLogger(__name__)

__all__ = ["EngineHost", "FrontendProcess", "RemoteEngine", "job_from_json", "job_to_json"]


# ---- the wire format -------------------------------------------------------------------------------

def job_to_json(job: GenerateJob) -> dict[str, Any]:
    out = dataclasses.asdict(job)
    out["sampling"]["logit_bias"] = [[int(k), float(v)] for k, v in job.sampling.logit_bias.items()]
    return out


def job_from_json(obj: dict[str, Any]) -> GenerateJob:
    sampling = dict(obj["sampling"])
    sampling["logit_bias"] = {int(k): float(v) for k, v in sampling["logit_bias"]}
    return GenerateJob(prompt_ids=[int(t) for t in obj["prompt_ids"]], max_new_tokens=int(obj["max_new_tokens"]),
                       sampling=Sampling(**sampling), eod=obj["eod"],
                       stop_token_sequences=[[int(t) for t in s] for s in obj["stop_token_sequences"]],
                       top_logprobs=int(obj["top_logprobs"]))


def _event_to_json(event: TokenEvent) -> list[Any]:
    top = None if event.top_logprobs is None else [[int(t), float(v)] for t, v in event.top_logprobs]
    return [event.token, event.logprob, top, event.finish_reason, event.error]


def _event_from_json(obj: list[Any]) -> TokenEvent:
    token, logprob, top, reason, error = obj
    return TokenEvent(int(token), float(logprob), None if top is None else [(int(t), float(v)) for t, v in top],
                      reason, error)


class _Channel:
    """One end of the pipe: JSON messages, sends serialised by a lock (several threads send)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":"), allow_nan=True).encode()
        with self._lock:
            self.conn.send_bytes(data)

    def recv(self) -> dict[str, Any]:
        return json.loads(self.conn.recv_bytes().decode())


# ---- the model's process ---------------------------------------------------------------------------

class EngineHost:
    """Runs the child's requests on ``engine`` (see the module docstring); :meth:`run` until the pipe
    closes or the child says "close"."""

    def __init__(self, engine: Any, conn: Any) -> None:
        self.engine = engine
        self.channel = _Channel(conn)
        self._handles: dict[int, Any] = {}
        self._events: collections.deque[tuple[int, TokenEvent]] = collections.deque()
        self._pending = threading.Condition()
        self._done = False
        self._sender = threading.Thread(target=self._send_events, name="engine-host-events", daemon=True)

    def run(self) -> None:
        self._sender.start()
        try:
            while True:
                try:
                    message = self.channel.recv()
                except (EOFError, OSError):
                    return
                if message["op"] == "close":
                    return
                self._handle(message)
        finally:
            with self._pending:
                self._done = True
                self._pending.notify()
            self._sender.join(5)

    def _handle(self, message: dict[str, Any]) -> None:
        op, ident = message["op"], message.get("id")
        if op == "submit":
            try:
                job = job_from_json(message["job"])
                self._handles[ident] = self.engine.submit(job, lambda e, i=ident: self._queue(i, e))
                self.channel.send({"op": "submitted", "id": ident})
            except EngineFull as e:
                self.channel.send({"op": "refused", "id": ident, "kind": "full", "message": str(e),
                                   "retry_after": e.retry_after_s})
            except (ValueError, TypeError, KeyError) as e:
                self.channel.send({"op": "refused", "id": ident, "kind": "value", "message": str(e)})
        elif op == "cancel":
            handle = self._handles.get(ident)
            if handle is not None:
                handle.cancel()
        elif op == "call":
            try:
                future = self.engine.call(message["name"], message["payload"])
            except Exception as e:  # noqa: BLE001 - the child's future gets it
                self._answer_call(ident, None, e)
                return
            future.add_done_callback(lambda f, i=ident: self._answer_call(i, f, None))

    def _answer_call(self, ident: int, future: Future | None, error: BaseException | None) -> None:
        if future is not None:
            error = future.exception()
        try:
            if error is None:
                self.channel.send({"op": "result", "id": ident, "value": future.result()})
                return
        except (TypeError, ValueError) as e:  # a result that is not plain JSON
            error = RuntimeError(f"the call's result cannot cross to the front end: {e}")
        kind = "full" if isinstance(error, EngineFull) else "value" if isinstance(error, ValueError) else "other"
        self.channel.send({"op": "error", "id": ident, "kind": kind, "message": str(error),
                           "type": type(error).__name__,
                           "retry_after": getattr(error, "retry_after_s", 1)})

    def _queue(self, ident: int, event: TokenEvent) -> None:
        """The engine thread's callback: append only (the sender thread sends)."""
        self._events.append((ident, event))
        if event.finish_reason is not None:
            self._handles.pop(ident, None)
        with self._pending:
            self._pending.notify()

    def _send_events(self) -> None:
        while True:
            with self._pending:
                while not self._events and not self._done:
                    self._pending.wait()
                if not self._events and self._done:
                    return
            batch = []
            while self._events:
                ident, event = self._events.popleft()
                batch.append([ident, _event_to_json(event)])
            try:
                self.channel.send({"op": "events", "events": batch})
            except (OSError, ValueError):
                return  # the front end is gone


# ---- the front end's process -----------------------------------------------------------------------

class _RemoteHandle:
    def __init__(self, engine: RemoteEngine, ident: int) -> None:
        self.engine, self.ident = engine, ident

    def cancel(self) -> None:
        try:
            self.engine._send({"op": "cancel", "id": self.ident})
        except RuntimeError:  # the engine is gone or closed: nothing runs to cancel
            pass


class RemoteEngine:
    """The engine seen from the front end's process (see the module docstring)."""

    def __init__(self, conn: Any, max_sequence_length: int) -> None:
        self.max_sequence_length = max_sequence_length
        self.channel = _Channel(conn)
        self._ids = itertools.count()
        self._listeners: dict[int, Callable[[TokenEvent], None]] = {}
        self._answers: dict[int, tuple[threading.Event, list[dict[str, Any]]]] = {}
        self._calls: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.on_lost: Callable[[], None] | None = None  # called once the engine's process is gone
        self._reader = threading.Thread(target=self._read, name="remote-engine", daemon=True)
        self._reader.start()

    def _send(self, message: dict[str, Any]) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")
        try:
            self.channel.send(message)
        except OSError:  # a broken pipe: the engine's process has ended
            raise RuntimeError("the engine's process is gone") from None

    def submit(self, job: GenerateJob, on_event: Callable[[TokenEvent], None]) -> _RemoteHandle:
        ident = next(self._ids)
        answered: tuple[threading.Event, list[dict[str, Any]]] = (threading.Event(), [])
        with self._lock:
            self._listeners[ident] = on_event
            self._answers[ident] = answered
        self._send({"op": "submit", "id": ident, "job": job_to_json(job)})
        if not answered[0].wait(60):
            raise RuntimeError("the engine did not answer the submission within 60 s")
        (reply,) = answered[1]
        if reply["op"] == "refused":
            with self._lock:
                self._listeners.pop(ident, None)
            if reply["kind"] == "full":
                raise EngineFull(reply["message"], int(reply.get("retry_after", 1)))
            raise ValueError(reply["message"])
        return _RemoteHandle(self, ident)

    def register(self, name: str, fn: Callable[[Any, dict[str, Any]], Any]) -> None:
        raise RuntimeError("register functions on the engine in the model's process")

    def call(self, name: str, payload: dict[str, Any]) -> Future:
        ident = next(self._ids)
        future: Future = Future()
        with self._lock:
            self._calls[ident] = future
        try:
            self._send({"op": "call", "id": ident, "name": name, "payload": payload})
        except (TypeError, ValueError) as e:
            raise ValueError(f"call {name!r}: the payload must be plain JSON ({e})") from None
        return future

    def close(self) -> None:
        if not self._closed:
            try:
                self.channel.send({"op": "close"})
            except (OSError, ValueError):
                pass
            self._closed = True

    def _read(self) -> None:
        while True:
            try:
                message = self.channel.recv()
            except (EOFError, OSError):
                self._fail_all("the engine's process is gone")
                if self.on_lost is not None:
                    self.on_lost()
                return
            op = message["op"]
            if op == "events":
                for ident, obj in message["events"]:
                    event = _event_from_json(obj)
                    with self._lock:
                        listener = (self._listeners.pop(ident, None) if event.finish_reason is not None
                                    else self._listeners.get(ident))
                    if listener is not None:
                        try:
                            listener(event)
                        except Exception:  # noqa: BLE001 - one request's callback, not the reader
                            log.exception("job %d: the event callback failed", ident)
            elif op in ("submitted", "refused"):
                with self._lock:
                    answered = self._answers.pop(message["id"], None)
                if answered is not None:
                    answered[1].append(message)
                    answered[0].set()
            elif op in ("result", "error"):
                with self._lock:
                    future = self._calls.pop(message["id"], None)
                if future is None:
                    continue
                if op == "result":
                    future.set_result(message["value"])
                elif message["kind"] == "full":
                    future.set_exception(EngineFull(message["message"], int(message.get("retry_after", 1))))
                elif message["kind"] == "value":
                    future.set_exception(ValueError(message["message"]))
                else:
                    future.set_exception(RuntimeError(f"{message.get('type', 'error')}: {message['message']}"))

    def _fail_all(self, why: str) -> None:
        self._closed = True
        with self._lock:
            listeners, self._listeners = dict(self._listeners), {}
            calls, self._calls = dict(self._calls), {}
            answers, self._answers = dict(self._answers), {}
        for ident, (event, box) in answers.items():
            box.append({"op": "refused", "kind": "value", "message": why})
            event.set()
        for listener in listeners.values():
            try:
                listener(TokenEvent(-1, 0.0, finish_reason="error", error=why))
            except Exception:  # noqa: BLE001
                pass
        for future in calls.values():
            future.set_exception(RuntimeError(why))


def _frontend_main(conn: Any, sock: socket.socket, settings: dict[str, Any], tokenizer_args: Any,
                   quiet: bool) -> None:
    """The child: the app over a RemoteEngine on the parent's socket, until the parent stops it."""
    from megatrain.data.tokenizers import build_tokenizer
    from megatrain.inference.server_app import TextGenerationServer
    from megatrain.inference.server_common import ServerContext

    engine = RemoteEngine(conn, settings.pop("max_sequence_length"))
    ctx = ServerContext(engine=engine, tokenizer=build_tokenizer(tokenizer_args), **settings)
    server = TextGenerationServer(ctx, sock=sock, quiet=quiet)
    engine.on_lost = lambda: setattr(server.server, "should_exit", True)  # the parent died: stop serving
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        engine.close()


class FrontendProcess:
    """:class:`~megatrain.inference.server_app.TextGenerationServer`'s interface with the app in a
    child process: bound at construction (``port`` 0: a free one), :meth:`start` or :meth:`serve_forever`
    host the engine's side in this process; :meth:`shutdown` stops the child; :meth:`server_close`
    closes the socket and the engine."""

    def __init__(self, ctx: Any, tokenizer_args: Any, host: str = "127.0.0.1", port: int = 5000,
                 quiet: bool = False) -> None:
        from megatrain.inference.server_app import LISTEN_BACKLOG

        if ctx.vision is not None:
            raise ValueError("a vision-language model is served in one process (its image requests carry "
                             "tensors through a registered call)")
        self.ctx = ctx
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        self.server_address = self.socket.getsockname()[:2]
        settings = {"max_sequence_length": int(ctx.engine.max_sequence_length), "limits": ctx.limits,
                    "model_name": ctx.model_name, "seq2seq": ctx.seq2seq, "max_positions": ctx.max_positions,
                    "log_requests": ctx.log_requests}
        spawn = multiprocessing.get_context("spawn")
        parent_end, child_end = spawn.Pipe(duplex=True)
        self._host = EngineHost(ctx.engine, parent_end)
        self._child = spawn.Process(target=_frontend_main, name="megatrain-http",
                                    args=(child_end, self.socket, settings, tokenizer_args, quiet), daemon=True)
        self._child_end = child_end
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def _launch(self) -> None:
        self._child.start()
        self._child_end.close()

    def serve_forever(self) -> None:
        """Serve until the child ends (or KeyboardInterrupt): the engine's side runs in this thread."""
        self._launch()
        try:
            self._host.run()
        finally:
            self._child.join(10)

    def start(self, ready_timeout: float = 120.0) -> None:
        """Serve from a background thread; returns once the child accepts connections."""
        self._launch()
        self._thread = threading.Thread(target=self._host.run, name="engine-host", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline and self._child.is_alive():
            try:
                with socket.create_connection(("127.0.0.1" if self.server_address[0] in ("0.0.0.0", "")
                                               else self.server_address[0], self.port), timeout=1) as probe:
                    probe.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if probe.recv(12).startswith(b"HTTP/1.1 200"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the HTTP front end's process did not start")

    def shutdown(self) -> None:
        if self._child.is_alive():
            self._child.terminate()
            self._child.join(10)
        if self._thread is not None:
            self._thread.join(10)

    def server_close(self) -> None:
        self.socket.close()
        self.ctx.engine.close()
