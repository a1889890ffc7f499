"""One preprocessing run, start to end: `preprocess` checks the flags and inputs, locks the output
prefixes, feeds the encoded chunks (in input order) to the writers, counts and reports bad lines
(``--skip-bad-lines``), shows progress, and publishes the outputs or rolls them back."""

from __future__ import annotations

import os
import sys
import time

from megatrain.data.preprocess.config import PreprocessConfig, PreprocessError, PreprocessStats, _check_config
from megatrain.data.preprocess.encode import _Encoder
from megatrain.data.preprocess.inputs import expand_inputs
from megatrain.data.preprocess.outputs import _lock_outputs, _Outputs, _prepare_output_dir
from megatrain.data.preprocess.workers import _encoded_chunks

__all__ = ["preprocess"]

MAX_REPORTED_BAD_LINES = 10


class _Progress:
    def __init__(self, cfg: PreprocessConfig, total_bytes: int | None):
        self.cfg = cfg
        self.start = time.time()
        self.docs = self.tokens = self.bytes = 0
        self.next_log = cfg.log_interval
        self.bar = None
        if cfg.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                            desc="preprocess", file=sys.stderr, dynamic_ncols=True)

    def update(self, docs: int, tokens: int, nbytes: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes += nbytes
        elapsed = max(time.time() - self.start, 1e-9)
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix_str(
                f"{self.docs} docs, {self.docs / elapsed:,.0f} docs/s, {self.tokens / elapsed / 1e6:.2f}M tok/s",
                refresh=False,
            )
        elif self.cfg.progress and self.cfg.log_interval > 0 and self.docs >= self.next_log:
            while self.next_log <= self.docs:
                self.next_log += self.cfg.log_interval
            print(
                f"Processed {self.docs} documents ({self.docs / elapsed:.1f} docs/s, "
                f"{self.tokens / elapsed:,.0f} tokens/s, {self.bytes / elapsed / 1024 / 1024:.2f} MB/s).",
                file=sys.stderr, flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _reason_kind(message: str) -> str:
    for kind in ("invalid JSON", "missing JSON key", "not valid UTF-8", "expected a JSON object",
                 "cannot tokenize", "JSON key"):
        if kind in message:
            return kind
    return "other"


def preprocess(cfg: PreprocessConfig, stats: PreprocessStats | None = None) -> list[str]:
    """Run the whole conversion; returns the output prefixes (one per json key).

    Every output prefix is locked (``PREFIX.lock``) for the whole run. The outputs are written
    under temporary names and renamed only once all of them are complete; on any failure or
    interruption this run removes exactly the files it created (its temporary files, its
    partitions) and puts back whatever it had already replaced, never anything else.
    """
    _check_config(cfg)
    files = expand_inputs(cfg.input)
    stats = stats if stats is not None else PreprocessStats()
    _prepare_output_dir(cfg)
    prefixes = cfg.output_prefixes()
    locks = _lock_outputs(cfg, prefixes)
    try:
        return _preprocess_locked(cfg, files, prefixes, stats)
    finally:
        for lock in locks:
            lock.release()


def _preprocess_locked(cfg: PreprocessConfig, files: list[str], prefixes: list[str],
                       stats: PreprocessStats) -> list[str]:
    encoder = _Encoder(cfg, files)
    if cfg.append_eod and encoder.eod is None:
        raise PreprocessError(
            f"--append-eod: the {cfg.tokenizer.tokenizer_type} tokenizer has no end-of-document token"
        )
    outputs = _Outputs(cfg, prefixes, encoder.dtype)
    total = None
    if not any(f.endswith(".gz") for f in files):
        total = sum(os.path.getsize(f) for f in files)
    progress = _Progress(cfg, total)
    start = time.time()
    chunks = None
    try:
        outputs.open()
        reported = 0
        chunks = _encoded_chunks(cfg, files, encoder)
        for result in chunks:
            if result.errors:
                if not cfg.skip_bad_lines:
                    raise PreprocessError(
                        f"{result.errors[0][1]} (use --skip-bad-lines to skip and count such lines)"
                    )
                for _, msg in result.errors:
                    stats.bad_reasons[_reason_kind(msg)] += 1
                    if reported < MAX_REPORTED_BAD_LINES:
                        print(f"skipping bad line: {msg}", file=sys.stderr)
                        reported += 1
                stats.bad_lines += len(result.errors)
            n_docs = len(result.doc_line_offsets)
            outputs.add(result, stats.lines)
            tokens = sum(int(result.keys[k].ids.size) for k in cfg.json_keys)
            stats.documents += n_docs
            stats.tokens += tokens
            stats.bytes += result.nbytes
            stats.lines += result.n_lines
            stats.blank_lines += result.n_blank
            stats.empty_documents += result.n_empty_docs
            stats.empty_sentences += result.n_empty_sentences
            progress.update(n_docs, tokens, result.nbytes)
            if cfg.max_documents is not None and stats.documents >= cfg.max_documents:
                break
        chunks.close()
        outputs.publish(stats)
    except BaseException as e:
        if chunks is not None:
            chunks.close()  # stops the worker pool before anything is removed
        outputs.roll_back(stats.outputs_written)
        if isinstance(e, OSError):
            name = getattr(e, "filename2", None) or e.filename
            where = f" {name}" if name else ""
            raise PreprocessError(
                f"--output-prefix {cfg.output_prefix}: cannot write{where} ({e.strerror or e})"
            ) from None
        raise
    finally:
        progress.close()
        outputs.remove_partitions()
    stats.seconds = time.time() - start
    return prefixes
