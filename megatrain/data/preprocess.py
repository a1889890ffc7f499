"""jsonl / plain text -> Megatron ``.bin/.idx`` (``tools/preprocess_data.py``).

Reads ``--input`` (a file, a glob, ``.gz`` of either; ``.txt``/``.text`` files are plain text
with one document per line, anything else is jsonl), tokenizes each ``--json-keys`` field in
``--workers`` processes, and writes ``{output_prefix}_{key}_{document|sentence}.bin/.idx``
byte-identical to Megatron-LM's for the same token ids.

Behaviour worth knowing (also in docs/data.md):

* Order is preserved: documents are written in input order (files in sorted glob order).
  With ``--partitions P > 1`` (and no ``--keep-sequential-samples``) the output order is
  Megatron's: input line ``i`` goes to partition ``i % P`` and partitions are concatenated.
* An empty document (no tokens) adds no sequence but keeps a document boundary, as
  Megatron-LM's ``add_document`` does; empty sentences are dropped. Both are counted.
* Blank lines in jsonl files are skipped and counted. Malformed JSON, a missing key, a value
  that is not text, non-UTF-8 bytes or text the tokenizer rejects stop the run with
  ``FILE:LINE: reason``; ``--skip-bad-lines`` skips such lines, counts them and reports.
* Outputs appear only when complete: a crash, Ctrl-C or SIGTERM leaves no ``.bin/.idx``
  under the final names (and no temporary files); with several outputs (``--json-keys``)
  they are renamed together once all are complete. An interrupted or failed run removes
  only files it created itself.
* Each output prefix is locked (``PREFIX.lock``, naming the holder) for the whole run: a
  second run on the same prefix stops at once with one line saying who holds it.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import gzip
import json
import multiprocessing as mp
import os
import re
import signal
import socket
import sys
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from megatrain.data.indexed_dataset import IndexedDatasetWriter, best_dtype
from megatrain.data.tokenizers import MegatrainTokenizer, TokenizerConfig, add_tokenizer_args, build_tokenizer
from megatrain.json_input import parse_json
from megatrain.locking import Lock, LockHeld, acquire

__all__ = [
    "PreprocessConfig",
    "PreprocessError",
    "build_parser",
    "expand_inputs",
    "iter_texts",
    "main",
    "parse_line",
    "preprocess",
    "split_sentences",
]

CHUNK_BYTES = 1 << 20  # lines are sent to workers in chunks of about this many bytes
CHUNK_LINES = 4096
MAX_REPORTED_BAD_LINES = 10


class PreprocessError(ValueError):
    """A user-facing problem with the input or the flags."""


@dataclass
class PreprocessConfig:
    input: str
    output_prefix: str
    tokenizer: TokenizerConfig
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    split_sentences: bool = False
    keep_newlines: bool = False
    append_eod: bool = False
    lang: str = "english"
    workers: int = 1
    partitions: int = 1
    keep_sequential_samples: bool = False
    log_interval: int = 1000
    skip_bad_lines: bool = False
    #: "auto" (by file name), "jsonl" or "text"
    input_format: str = "auto"
    #: show a tqdm progress bar (when stderr is a terminal); else log lines every log_interval docs
    progress: bool = True

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def output_prefixes(self) -> list[str]:
        return [f"{self.output_prefix}_{key}_{self.level}" for key in self.json_keys]


# ----------------------------------------------------------------------------------------
# input files
# ----------------------------------------------------------------------------------------
def expand_inputs(pattern: str | Sequence[str], flag: str = "--input") -> list[str]:
    """Files named by a path or glob (or several), sorted, each checked to exist."""
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    files: list[str] = []
    for pat in patterns:
        if glob.has_magic(pat):
            matched = sorted(p for p in glob.glob(pat, recursive=True) if os.path.isfile(p))
            if not matched:
                raise PreprocessError(f"{flag} {pat}: the pattern matches no files")
            files.extend(matched)
        elif os.path.isfile(pat):
            files.append(pat)
        elif os.path.isdir(pat):
            raise PreprocessError(f"{flag} {pat}: is a directory; pass a file or a glob such as '{pat}/*.jsonl'")
        else:
            raise PreprocessError(f"{flag} {pat}: no such file")
    return files


def input_format_of(path: str, requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    name = path[:-3] if path.endswith(".gz") else path
    return "text" if name.endswith((".txt", ".text")) else "jsonl"


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


@dataclass
class _Chunk:
    file_index: int
    first_lineno: int  # 1-based line number in its file
    first_global_line: int  # 0-based line index over all files (for --partitions order)
    lines: list[bytes]
    nbytes: int


def _iter_chunks(files: list[str]) -> Iterator[_Chunk]:
    global_line = 0
    for fi, path in enumerate(files):
        lines: list[bytes] = []
        nbytes, first = 0, 1
        lineno = 0
        try:
            with _open_binary(path) as f:
                for line in f:
                    lineno += 1
                    lines.append(line)
                    nbytes += len(line)
                    if nbytes >= CHUNK_BYTES or len(lines) >= CHUNK_LINES:
                        yield _Chunk(fi, first, global_line, lines, nbytes)
                        global_line += len(lines)
                        first, lines, nbytes = lineno + 1, [], 0
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise PreprocessError(f"{path}: cannot read the file after line {lineno} ({e})") from None
        if lines:
            yield _Chunk(fi, first, global_line, lines, nbytes)
            global_line += len(lines)


# ----------------------------------------------------------------------------------------
# sentence splitting (rule-based, offline)
# ----------------------------------------------------------------------------------------
_SENTENCE_END = re.compile(r"([.!?\u2026]+[\"'\u201d\u2019)\]]*)(\s+)")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt vs etc e.g i.e eg ie inc ltd co corp no nos fig figs al cf approx "
    "dept est gen gov lt col sgt capt rev jan feb mar apr jun jul aug sep sept oct nov dec u.s u.k "
    "a.m p.m ph.d vol vols pp ed eds".split()
)


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """Split English-like text into sentences without any downloaded model.

    A sentence ends at ``. ! ? …`` (plus closing quotes/brackets) followed by whitespace and
    an upper-case letter, digit, quote or bracket; common abbreviations and single-letter
    initials do not end sentences. Without ``keep_newlines`` the whitespace between sentences
    is dropped; with it, that whitespace stays at the end of the sentence before it, so the
    sentences join back to exactly the original text.
    """
    out: list[str] = []
    start = 0
    for m in _SENTENCE_END.finditer(text):
        after = m.end()
        if after >= len(text):
            break
        nxt = text[after]
        if not (nxt.isupper() or nxt.isdigit() or nxt in "\"'\u201c\u2018([" or "\n\n" in m.group(2)):
            continue
        if m.group(1)[0] == ".":
            word = text[start : m.start(1)].rsplit(None, 1)
            word = word[-1] if word else ""
            w = word.lower().lstrip("(\"'")
            if w in _ABBREVIATIONS or (len(w) == 1 and w.isalpha()):
                continue
        piece = text[start:after] if keep_newlines else text[start : m.end(1)]
        out.append(piece)
        start = after
    out.append(text[start:])
    if keep_newlines:
        return [s for s in out if s]
    return [s.strip() for s in out if s.strip()]


# ----------------------------------------------------------------------------------------
# parsing lines
# ----------------------------------------------------------------------------------------
def parse_line(raw: bytes, fmt: str, json_keys: Sequence[str], where: str) -> dict[str, list[str] | str] | str | None:
    """The texts of one input line per key, None for a blank jsonl line, or an error message
    starting with ``where`` (``FILE:LINE``)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte offset {e.start} of the line)"
    if fmt == "text":
        if line.endswith("\n"):
            line = line[:-1]
            if line.endswith("\r"):
                line = line[:-1]
        return {key: line for key in json_keys}
    if not line.strip():
        return None
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        return f"{where}: invalid JSON ({e.msg} at column {e.colno})"
    except (RecursionError, ValueError):  # nested too deep, an integer of thousands of digits
        try:
            parse_json(line)
        except ValueError as e:
            return f"{where}: invalid JSON ({e})"
        return f"{where}: invalid JSON"
    if not isinstance(data, dict):
        return f"{where}: expected a JSON object, got {type(data).__name__}"
    out = {}
    for key in json_keys:
        if key not in data:
            present = ", ".join(list(data)[:10]) or "none"
            return f"{where}: missing JSON key {key!r} (keys on this line: {present}; see --json-keys)"
        value = data[key]
        if isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(s, str) for s in value)
        ):
            out[key] = value
        else:
            return f"{where}: JSON key {key!r} holds {type(value).__name__}, expected a string or a list of strings"
    return out


# ----------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------
@dataclass
class _KeyResult:
    ids: np.ndarray  # all token ids of the chunk's good documents, concatenated
    sequence_lengths: np.ndarray  # int32, one per sequence
    sequences_per_doc: np.ndarray  # int32, one per good document


@dataclass
class _ChunkResult:
    n_lines: int
    nbytes: int
    errors: list[tuple[int, str]]  # (line number, reason)
    n_blank: int
    doc_line_offsets: np.ndarray  # line offset inside the chunk of each good document
    keys: dict[str, _KeyResult]
    n_empty_docs: int
    n_empty_sentences: int


class _Encoder:
    """Everything a worker needs; built once per process."""

    def __init__(self, cfg: PreprocessConfig, files: list[str]):
        self.cfg = cfg
        self.files = files
        self.formats = [input_format_of(f, cfg.input_format) for f in files]
        self.tokenizer: MegatrainTokenizer = build_tokenizer(cfg.tokenizer)
        self.dtype = np.dtype(best_dtype(self.tokenizer.vocab_size))
        self.max_id = int(np.iinfo(self.dtype).max)
        self.eod = self.tokenizer.eod

    def encode_chunk(self, chunk: _Chunk) -> _ChunkResult:
        cfg = self.cfg
        path, fmt = self.files[chunk.file_index], self.formats[chunk.file_index]
        keys = cfg.json_keys
        arrays: dict[str, list[np.ndarray]] = {k: [] for k in keys}
        seq_lens: dict[str, list[int]] = {k: [] for k in keys}
        per_doc: dict[str, list[int]] = {k: [] for k in keys}
        doc_offsets: list[int] = []
        errors: list[tuple[int, str]] = []
        n_blank = n_empty_docs = n_empty_sents = 0
        eod = None
        if cfg.append_eod:
            eod = np.array([self.eod], dtype=np.int64)
        for offset, raw in enumerate(chunk.lines):
            lineno = chunk.first_lineno + offset
            where = f"{path}:{lineno}"
            texts = parse_line(raw, fmt, self.cfg.json_keys, where)
            if texts is None:
                n_blank += 1
                continue
            if isinstance(texts, str):
                errors.append((lineno, texts))
                continue
            doc: dict[str, tuple[list[np.ndarray], list[int]]] = {}
            try:
                for key in keys:
                    value = texts[key]
                    if isinstance(value, list):
                        sentences = value
                    elif cfg.split_sentences:
                        sentences = split_sentences(value, cfg.keep_newlines)
                    else:
                        sentences = [value]
                    parts, lens = [], []
                    for s in sentences:
                        ids = self.tokenizer.tokenize_to_numpy(s, np.int64)
                        if ids.size:
                            parts.append(ids)
                            lens.append(int(ids.size))
                        else:
                            n_empty_sents += 1
                    if lens and eod is not None:
                        parts.append(eod)
                        lens[-1] += 1
                    doc[key] = (parts, lens)
            except ValueError as e:
                errors.append((lineno, f"{where}: cannot tokenize key {key!r} ({e})"))
                continue
            doc_offsets.append(offset)
            if all(not lens for _, lens in doc.values()):
                n_empty_docs += 1
            for key, (parts, lens) in doc.items():
                arrays[key].extend(parts)
                seq_lens[key].extend(lens)
                per_doc[key].append(len(lens))
        results = {}
        for key in keys:
            ids = np.concatenate(arrays[key]) if arrays[key] else np.zeros(0, np.int64)
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) > self.max_id):
                bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                raise PreprocessError(
                    f"{path}: token id {bad} does not fit {self.dtype.name} (vocab size "
                    f"{self.tokenizer.vocab_size}); the tokenizer produced an id outside its vocabulary"
                )
            results[key] = _KeyResult(
                ids.astype(self.dtype),
                np.asarray(seq_lens[key], dtype=np.int32),
                np.asarray(per_doc[key], dtype=np.int32),
            )
        return _ChunkResult(
            n_lines=len(chunk.lines),
            nbytes=chunk.nbytes,
            errors=errors,
            n_blank=n_blank,
            doc_line_offsets=np.asarray(doc_offsets, dtype=np.int64),
            keys=results,
            n_empty_docs=n_empty_docs,
            n_empty_sentences=n_empty_sents,
        )


_WORKER: _Encoder | None = None


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to kill this process when its parent ends (Linux), however it ends."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent was already gone before the request
        os._exit(1)


def _worker_init(cfg: PreprocessConfig, files: list[str], parent_pid: int) -> None:
    # Ctrl-C reaches the whole process group: only the parent acts on it. SIGTERM (sent by
    # the parent's pool on shutdown) ends a worker at once and quietly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent_pid)
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


# ----------------------------------------------------------------------------------------
# progress
# ----------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------
# the pipeline
# ----------------------------------------------------------------------------------------
@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    lines: int = 0
    blank_lines: int = 0
    empty_documents: int = 0
    empty_sentences: int = 0
    bad_lines: int = 0
    bad_reasons: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    #: True once every output is in place under its final name
    outputs_written: bool = False


def _check_config(cfg: PreprocessConfig) -> None:
    if cfg.workers < 1:
        raise PreprocessError(f"--workers must be at least 1, got {cfg.workers}")
    if cfg.partitions < 1:
        raise PreprocessError(f"--partitions must be at least 1, got {cfg.partitions}")
    if cfg.workers % cfg.partitions != 0:
        raise PreprocessError(
            f"--workers {cfg.workers} must be divisible by --partitions {cfg.partitions} (as in Megatron-LM)"
        )
    if not cfg.json_keys:
        raise PreprocessError("--json-keys needs at least one key")
    if len(set(cfg.json_keys)) != len(cfg.json_keys):
        raise PreprocessError(f"--json-keys has repeated keys: {cfg.json_keys}")
    if cfg.input_format not in ("auto", "jsonl", "text"):
        raise PreprocessError(f"unknown input format {cfg.input_format!r} (auto, jsonl or text)")


def _reason_kind(message: str) -> str:
    for kind in ("invalid JSON", "missing JSON key", "not valid UTF-8", "expected a JSON object",
                 "cannot tokenize", "JSON key"):
        if kind in message:
            return kind
    return "other"


def _prepare_output_dir(cfg: PreprocessConfig) -> None:
    """Create the directory of ``--output-prefix``; one clear error when that cannot be done."""
    flag = f"--output-prefix {cfg.output_prefix}"
    out_dir = os.path.dirname(os.path.abspath(cfg.output_prefix))
    probe = out_dir
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if os.path.lexists(probe) and not os.path.isdir(probe):
        raise PreprocessError(f"{flag}: {probe} is not a directory")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise PreprocessError(f"{flag}: cannot create the output directory {out_dir} ({e.strerror})") from None


def _lock_outputs(cfg: PreprocessConfig, prefixes: list[str]) -> list[Lock]:
    """``PREFIX.lock`` for every output prefix, so no two runs write the same files."""
    flag = f"--output-prefix {cfg.output_prefix}"
    locks: list[Lock] = []
    try:
        for prefix in prefixes:
            locks.append(acquire(prefix + ".lock", flag))
    except BaseException as e:
        for lock in locks:
            lock.release()
        if isinstance(e, LockHeld):
            raise PreprocessError(str(e)) from None
        if isinstance(e, OSError):
            raise PreprocessError(e.strerror or str(e)) from None
        raise
    for prefix, lock in zip(prefixes, locks):
        _remove_leftovers_of_dead_holder(prefix, lock)
    return locks


def _remove_leftovers_of_dead_holder(prefix: str, lock: Lock) -> None:
    """Temporary files of a run on this prefix that was killed (kill -9, power loss) before it
    could clean up: its lock was taken over, and its files carry its pid in their names."""
    holder = lock.stale_holder or {}
    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return
    base = glob.escape(prefix)
    removed = 0
    for pattern in (f"{base}.bin.tmp-{pid}-*", f"{base}.idx.tmp-{pid}-*", f"{base}.partition*.tmp-{pid}-*"):
        for path in glob.glob(pattern):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
                removed += 1
    if removed:
        print(f"removed {removed} temporary file(s) of {prefix} left by pid {pid}, which ended without "
              "cleaning up", file=sys.stderr)


def _remove_files(prefixes: list[str]) -> None:
    for p in prefixes:
        for ext in (".bin", ".idx"):
            try:
                os.remove(p + ext)
            except FileNotFoundError:
                pass


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
    n_parts = 1 if cfg.keep_sequential_samples else cfg.partitions
    run_tag = f"tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    part_prefixes = {
        key: [f"{prefix}.partition{k}.{run_tag}" for k in range(n_parts)]
        for key, prefix in zip(cfg.json_keys, prefixes)
    }
    made_parts: list[str] = []  # partition datasets this run finalized (temporary, removed at the end)
    writers: list[IndexedDatasetWriter] = []  # every writer of this run, aborted on failure
    total = None
    if not any(f.endswith(".gz") for f in files):
        total = sum(os.path.getsize(f) for f in files)
    progress = _Progress(cfg, total)
    start = time.time()
    chunks = None
    try:
        key_writers: dict[str, list[IndexedDatasetWriter]] = {}
        for key, prefix in zip(cfg.json_keys, prefixes):
            names = [prefix] if n_parts == 1 else part_prefixes[key]
            key_writers[key] = []
            for name in names:
                w = IndexedDatasetWriter(name, encoder.dtype)
                writers.append(w)
                key_writers[key].append(w)
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
            for key in cfg.json_keys:
                kr = result.keys[key]
                if n_parts == 1:
                    key_writers[key][0].add_documents(kr.ids, kr.sequence_lengths, kr.sequences_per_doc)
                else:
                    _add_round_robin(key_writers[key], kr, result, n_parts, stats.lines)
            tokens = sum(int(result.keys[k].ids.size) for k in cfg.json_keys)
            stats.documents += n_docs
            stats.tokens += tokens
            stats.bytes += result.nbytes
            stats.lines += result.n_lines
            stats.blank_lines += result.n_blank
            stats.empty_documents += result.n_empty_docs
            stats.empty_sentences += result.n_empty_sentences
            progress.update(n_docs, tokens, result.nbytes)
        chunks.close()
        if n_parts == 1:
            finals = writers
        else:
            for w in writers:
                made_parts.append(w.prefix)
                w.finalize()
            finals = []
            for key, prefix in zip(cfg.json_keys, prefixes):
                final = IndexedDatasetWriter(prefix, encoder.dtype)
                writers.append(final)
                finals.append(final)
                for p in part_prefixes[key]:
                    final.add_index(p)
        for w in finals:
            w.prepare()
        # Every output is complete under its temporary names: rename them one after the
        # other. Until the last rename, a failure (or an interruption) puts back the files
        # that the renames replaced, so the run leaves all of its outputs or none of them.
        for w in finals:
            w.publish()
        stats.outputs_written = True
        for w in finals:
            w.commit()
    except BaseException as e:
        if chunks is not None:
            chunks.close()  # stops the worker pool before anything is removed
        for w in reversed(writers):
            if stats.outputs_written and w in finals:
                if w.is_published:
                    w.commit()  # past the last rename: the new outputs stay
            else:
                w.abort()  # its own temporary files; puts back what it replaced, if it had published
        if isinstance(e, OSError):
            name = getattr(e, "filename2", None) or e.filename
            where = f" {name}" if name else ""
            raise PreprocessError(
                f"--output-prefix {cfg.output_prefix}: cannot write{where} ({e.strerror or e})"
            ) from None
        raise
    finally:
        progress.close()
        _remove_files(made_parts)
    stats.seconds = time.time() - start
    return prefixes


def _add_round_robin(writers, kr: _KeyResult, result: _ChunkResult, n_parts: int, lines_before: int) -> None:
    """Megatron's --partitions order: global input line i goes to partition i % P."""
    seq_start = np.concatenate([[0], np.cumsum(kr.sequences_per_doc, dtype=np.int64)])
    tok_ends = np.concatenate([[0], np.cumsum(kr.sequence_lengths, dtype=np.int64)])
    for d, line_offset in enumerate(result.doc_line_offsets):
        s0, s1 = seq_start[d], seq_start[d + 1]
        part = (lines_before + int(line_offset)) % n_parts
        writers[part].add_document(kr.ids[tok_ends[s0] : tok_ends[s1]], kr.sequence_lengths[s0:s1].tolist())


# ----------------------------------------------------------------------------------------
# text iteration for other tools (train-tokenizer)
# ----------------------------------------------------------------------------------------
def iter_texts(
    inputs: str | Sequence[str],
    json_keys: Sequence[str] = ("text",),
    skip_bad_lines: bool = False,
    input_format: str = "auto",
) -> Iterator[str]:
    """Every text of every document of the inputs, in order (same rules as preprocessing)."""
    files = expand_inputs(inputs)
    for path in files:
        fmt = input_format_of(path, input_format)
        for chunk in _iter_chunks([path]):
            for offset, raw in enumerate(chunk.lines):
                texts = parse_line(raw, fmt, json_keys, f"{path}:{chunk.first_lineno + offset}")
                if texts is None:
                    continue
                if isinstance(texts, str):
                    if skip_bad_lines:
                        continue
                    raise PreprocessError(texts)
                for key in json_keys:
                    value = texts[key]
                    if isinstance(value, list):
                        yield from value
                    else:
                        yield value


# ----------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="preprocess_data.py",
        description="Tokenize jsonl/text into Megatron .bin/.idx files.",
    )
    add_tokenizer_args(parser)
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True,
                       help="Input file or glob: jsonl (one JSON object per line), .txt/.text "
                            "(one document per line), or .gz of either.")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="Space separated list of keys to extract from json.")
    group.add_argument("--split-sentences", action="store_true", help="Split documents into sentences.")
    group.add_argument("--keep-newlines", action="store_true",
                       help="Keep newlines between sentences when splitting.")
    group.add_argument("--input-format", choices=["auto", "jsonl", "text"], default="auto",
                       help="Input format; auto: .txt/.text(.gz) are text, others jsonl.")
    group = parser.add_argument_group(title="tokenization process")
    group.add_argument("--append-eod", action="store_true",
                       help="Append an <eod> token to the end of a document.")
    group.add_argument("--lang", type=str, default="english",
                       help="Language for sentence splitting (the built-in splitter is for "
                            "languages written like English).")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True,
                       help="Path to binary output file without suffix.")
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, default=1, help="Number of worker processes to launch.")
    group.add_argument("--partitions", type=int, default=1,
                       help="Number of file partitions (output order as Megatron-LM's).")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="Keep input order even with --partitions > 1.")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="Interval (documents) between progress lines when there is no progress bar.")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="Skip malformed lines (bad JSON, missing key, non-UTF-8), count and report them.")
    group.add_argument("--no-progress", dest="progress", action="store_false",
                       help="No progress bar or progress lines.")
    return parser


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    return PreprocessConfig(
        input=args.input,
        output_prefix=args.output_prefix,
        tokenizer=TokenizerConfig.from_namespace(args),
        json_keys=list(args.json_keys),
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        append_eod=args.append_eod,
        lang=args.lang,
        workers=args.workers,
        partitions=args.partitions,
        keep_sequential_samples=args.keep_sequential_samples,
        log_interval=args.log_interval,
        skip_bad_lines=args.skip_bad_lines,
        input_format=args.input_format,
        progress=args.progress,
    )


class _Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the main process (``signum`` says which)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_interrupt():
    """In the main process, SIGTERM and SIGINT raise `_Interrupted` (once: a second signal
    during the clean-up that follows is ignored); forked children get the default actions."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    main_pid = os.getpid()

    def handler(signum, frame):
        if os.getpid() != main_pid:  # a child forked before it reset its handlers
            if signum == signal.SIGTERM:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _Interrupted(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def main(argv: Sequence[str] | None = None) -> list[str]:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    stats = PreprocessStats()
    try:
        with _signals_interrupt():
            prefixes = preprocess(cfg, stats)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt as e:
        code = 128 + e.signum if isinstance(e, _Interrupted) else 130
        if stats.outputs_written:
            print("interrupted: the output files had already been written completely", file=sys.stderr)
        else:
            print("interrupted: no output files were written", file=sys.stderr)
        raise SystemExit(code) from None
    secs = max(stats.seconds, 1e-9)
    print(
        f"Processed {stats.documents} documents, {stats.tokens} tokens, {stats.bytes / 1024 / 1024:.2f} MB "
        f"in {stats.seconds:.2f}s ({stats.documents / secs:.1f} docs/s, {stats.tokens / secs:,.0f} tokens/s, "
        f"{stats.bytes / secs / 1024 / 1024:.2f} MB/s) with {cfg.workers} worker(s)."
    )
    if stats.empty_documents:
        print(f"{stats.empty_documents} empty document(s): no sequence written, document boundary kept.")
    if stats.blank_lines:
        print(f"{stats.blank_lines} blank line(s) skipped.")
    if stats.bad_lines:
        kinds = ", ".join(f"{n} {k}" for k, n in stats.bad_reasons.most_common())
        print(f"skipped {stats.bad_lines} bad line(s): {kinds}.")
    for p in prefixes:
        print(f"wrote {p}.bin and {p}.idx")
    return prefixes


if __name__ == "__main__":
    main()
