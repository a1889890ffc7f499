"""Where a run writes: the directory of ``--output-prefix``, the ``PREFIX.lock`` of every output
prefix (and the temporary files of a killed holder of it), and `_Outputs`, the run's writers, which
publish all outputs together once all are complete and roll back to the files they replaced when
the run fails or is interrupted. A run removes only files it created itself."""

from __future__ import annotations

import contextlib
import glob
import os
import socket
import sys
import uuid

import numpy as np

from megatrain.data.indexed_dataset import IndexedDatasetWriter
from megatrain.data.preprocess.config import PreprocessConfig, PreprocessError, PreprocessStats
from megatrain.data.preprocess.encode import _ChunkResult, _KeyResult
from megatrain.locking import Lock, LockHeld, acquire


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


class _Outputs:
    """The `IndexedDatasetWriter` of every output of one run (of every partition with
    ``--partitions P > 1``), published together or not at all.

    `publish` makes every output complete under its temporary name before renaming any; until
    the last rename, `roll_back` puts back the files that the renames replaced, so a run leaves
    all of its outputs or none of them. Partition datasets are temporary: `remove_partitions`
    deletes them whatever happened.
    """

    def __init__(self, cfg: PreprocessConfig, prefixes: list[str], dtype: np.dtype):
        self.cfg = cfg
        self.prefixes = prefixes
        self.dtype = dtype
        self.n_parts = 1 if cfg.keep_sequential_samples else cfg.partitions
        run_tag = f"tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.part_prefixes = {
            key: [f"{prefix}.partition{k}.{run_tag}" for k in range(self.n_parts)]
            for key, prefix in zip(cfg.json_keys, prefixes)
        }
        self.made_parts: list[str] = []  # partition datasets this run finalized (temporary, removed at the end)
        self.writers: list[IndexedDatasetWriter] = []  # every writer of this run, aborted on failure
        self.key_writers: dict[str, list[IndexedDatasetWriter]] = {}
        self.finals: list[IndexedDatasetWriter] = []

    def open(self) -> None:
        """A writer per output (per partition of each output with ``--partitions``)."""
        for key, prefix in zip(self.cfg.json_keys, self.prefixes):
            names = [prefix] if self.n_parts == 1 else self.part_prefixes[key]
            self.key_writers[key] = []
            for name in names:
                w = IndexedDatasetWriter(name, self.dtype)
                self.writers.append(w)
                self.key_writers[key].append(w)

    def add(self, result: _ChunkResult, lines_before: int) -> None:
        """One encoded chunk; ``lines_before``: the input lines before it (for the partition order)."""
        for key in self.cfg.json_keys:
            kr = result.keys[key]
            if self.n_parts == 1:
                self.key_writers[key][0].add_documents(kr.ids, kr.sequence_lengths, kr.sequences_per_doc)
            else:
                _add_round_robin(self.key_writers[key], kr, result, self.n_parts, lines_before)

    def publish(self, stats: PreprocessStats) -> None:
        """Join the partitions, complete every output, rename them all; sets ``stats.outputs_written``
        once the last rename is done."""
        if self.n_parts == 1:
            finals = self.writers
        else:
            for w in self.writers:
                self.made_parts.append(w.prefix)
                w.finalize()
            finals = []
            for key, prefix in zip(self.cfg.json_keys, self.prefixes):
                final = IndexedDatasetWriter(prefix, self.dtype)
                self.writers.append(final)
                finals.append(final)
                for p in self.part_prefixes[key]:
                    final.add_index(p)
        self.finals = finals
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

    def roll_back(self, outputs_written: bool) -> None:
        """After a failure or an interruption: every writer removes its own temporary files and
        puts back what it replaced; past the last rename (``outputs_written``) the new outputs stay."""
        for w in reversed(self.writers):
            if outputs_written and w in self.finals:
                if w.is_published:
                    w.commit()  # past the last rename: the new outputs stay
            else:
                w.abort()  # its own temporary files; puts back what it replaced, if it had published

    def remove_partitions(self) -> None:
        _remove_files(self.made_parts)


def _add_round_robin(writers, kr: _KeyResult, result: _ChunkResult, n_parts: int, lines_before: int) -> None:
    """Megatron's --partitions order: global input line i goes to partition i % P."""
    seq_start = np.concatenate([[0], np.cumsum(kr.sequences_per_doc, dtype=np.int64)])
    tok_ends = np.concatenate([[0], np.cumsum(kr.sequence_lengths, dtype=np.int64)])
    for d, line_offset in enumerate(result.doc_line_offsets):
        s0, s1 = seq_start[d], seq_start[d + 1]
        part = (lines_before + int(line_offset)) % n_parts
        writers[part].add_document(kr.ids[tok_ends[s0] : tok_ends[s1]], kr.sequence_lengths[s0:s1].tolist())
