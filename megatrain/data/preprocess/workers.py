"""Encoded chunks in input order: in this process with ``--workers 1``, else from a pool of forked
worker processes with a bounded number of chunks in flight (``2 * workers + 2``). Closing the
generator (or an exception in it) terminates the pool before anything else is cleaned up."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import deque
from typing import Iterator

from megatrain.data.preprocess.config import PreprocessConfig
from megatrain.data.preprocess.encode import _ChunkResult, _Encoder
from megatrain.data.preprocess.inputs import _Chunk, _iter_chunks
from megatrain.data.preprocess.signals import _worker_signals

_WORKER: _Encoder | None = None


def _worker_init(cfg: PreprocessConfig, files: list[str], parent_pid: int) -> None:
    _worker_signals(parent_pid)
    global _WORKER
    _WORKER = _Encoder(cfg, files)


def _worker_encode(chunk: _Chunk) -> _ChunkResult:
    assert _WORKER is not None
    return _WORKER.encode_chunk(chunk)


def _encoded_chunks(cfg: PreprocessConfig, files: list[str], encoder: _Encoder) -> Iterator[_ChunkResult]:
    """Encoded chunks in input order; at most a few chunks in flight per worker."""
    chunks = _iter_chunks(files)
    if cfg.workers <= 1:
        for chunk in chunks:
            yield encoder.encode_chunk(chunk)
        return
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("fork" if "fork" in methods else None)
    pool = ctx.Pool(cfg.workers, initializer=_worker_init, initargs=(cfg, files, os.getpid()))
    try:
        pending: deque = deque()
        limit = 2 * cfg.workers + 2
        for chunk in chunks:
            pending.append(pool.apply_async(_worker_encode, (chunk,)))
            if len(pending) >= limit:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()
