"""Encoded chunks in input order: in this process with ``--workers 1``, else from a small pool of
forked worker processes that share no lock with each other or with this process.

Each worker has its own two pipes (chunks in, results out); chunk ``i`` goes to worker ``i % N``
and the results are read back in the same order. A worker holds at most one chunk: it gets the
next one only after its previous result has been read, so a large chunk or result can never
leave both ends of a pipe blocked on a send. An exception in a worker comes back through its
result pipe and is raised here unchanged. On a normal end the workers are told to stop and are
joined; on any other exit (an error, `_Interrupted`, the consumer closing the generator) every
worker is killed (SIGKILL), the pipes are closed and the workers are reaped with a short
timeout, so clean-up never waits on a worker."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Iterator

from megatrain.data.preprocess.config import PreprocessConfig, PreprocessError
from megatrain.data.preprocess.encode import _ChunkResult, _Encoder
from megatrain.data.preprocess.inputs import _Chunk, _iter_chunks
from megatrain.data.preprocess.signals import _worker_signals

_WORKER: _Encoder | None = None
_JOIN_SECONDS = 2.0


def _worker_init(cfg: PreprocessConfig, files: list[str], parent_pid: int) -> None:
    _worker_signals(parent_pid)
    global _WORKER
    _WORKER = _Encoder(cfg, files)


def _worker_encode(chunk: _Chunk) -> _ChunkResult:
    assert _WORKER is not None
    return _WORKER.encode_chunk(chunk)


def _worker_main(cfg: PreprocessConfig, files: list[str], parent_pid: int, tasks, results) -> None:
    """A worker's life: set up, then encode chunks until ``None`` (or the end of the task pipe)."""
    try:
        _worker_init(cfg, files, parent_pid)
    except Exception as e:  # reported on the first chunk, as the parent reads results in order
        failed: Exception | None = e
    else:
        failed = None
    while True:
        try:
            chunk = tasks.recv()
        except EOFError:
            return
        if chunk is None:
            return
        if failed is not None:
            results.send((False, failed))
            continue
        try:
            reply = (True, _worker_encode(chunk))
        except Exception as e:
            reply = (False, e)
        try:
            results.send(reply)
        except Exception as e:  # e.g. an exception that cannot be pickled
            results.send((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]} ({e})")))


class _Worker:
    """One forked process and this process's ends of its two pipes."""

    def __init__(self, ctx, cfg: PreprocessConfig, files: list[str]):
        task_r, self.tasks = ctx.Pipe(duplex=False)
        self.results, result_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_worker_main, args=(cfg, files, os.getpid(), task_r, result_w),
                                daemon=True)
        self.proc.start()
        # Only the worker keeps its ends: a worker that dies is seen here as the end of its pipe,
        # and workers forked later never hold them.
        task_r.close()
        result_w.close()

    def result(self) -> _ChunkResult:
        try:
            ok, value = self.results.recv()
        except EOFError:
            raise PreprocessError(
                f"--workers: a worker process ended unexpectedly (exit code {self.proc.exitcode})"
            ) from None
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self.tasks.send(None)
        self.proc.join()

    def kill(self) -> None:
        if self.proc.pid is not None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for conn in (self.tasks, self.results):
            try:
                conn.close()
            except OSError:
                pass


def _encoded_chunks(cfg: PreprocessConfig, files: list[str], encoder: _Encoder) -> Iterator[_ChunkResult]:
    """Encoded chunks in input order; at most one chunk in flight per worker."""
    chunks = _iter_chunks(files)
    if cfg.workers <= 1:
        for chunk in chunks:
            yield encoder.encode_chunk(chunk)
        return
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("fork" if "fork" in methods else None)
    workers: list[_Worker] = []
    finished = False
    try:
        for _ in range(cfg.workers):
            workers.append(_Worker(ctx, cfg, files))
        busy = 0  # workers 0 .. busy-1 hold a chunk; the next result comes from worker `turn`
        for chunk in chunks:
            workers[busy].tasks.send(chunk)
            busy += 1
            if busy == len(workers):
                break
        turn = 0
        while busy:
            result = workers[turn].result()
            chunk = next(chunks, None)
            if chunk is not None:  # sent before yielding, so the worker encodes while we write
                workers[turn].tasks.send(chunk)
            else:
                busy -= 1
            yield result
            turn = (turn + 1) % len(workers)
        for w in workers:
            w.stop()
        finished = True
    finally:
        if not finished:
            for w in workers:
                w.kill()
        for w in workers:
            w.close()
        for w in workers:
            w.proc.join(_JOIN_SECONDS)
