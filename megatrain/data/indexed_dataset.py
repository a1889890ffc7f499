"""Megatron-LM indexed dataset files (``PREFIX.bin`` / ``PREFIX.idx``, the MMIDIDX format).

``.bin`` holds token ids back to back with no header. ``.idx`` (little-endian) holds:

    magic b"MMIDIDX\\x00\\x00" | <Q version=1 | <B dtype code | <Q S sequences | <Q D boundaries
    int32[S] sequence lengths | int64[S] sequence byte offsets | int64[D] document boundaries

A *sequence* is a run of tokens (one document, or one sentence with ``--split-sentences``);
``document_indices`` lists, for every document boundary, the index of the first sequence after
it, from 0 to S. Files written here are byte-identical to Megatron-LM's for the same ids.

This module owns the memory-mapped reader :class:`IndexedDataset` and the atomic writer
:class:`IndexedDatasetWriter` (temporary names, renamed only by :meth:`finalize`; an aborted
writer removes only the files it created).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import uuid
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "DTYPE_CODES",
    "HEADER_SIZE",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "MAGIC",
    "best_dtype",
    "bin_path",
    "dataset_exists",
    "idx_path",
]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes

#: Megatron's dtype codes, as stored in byte 17 of the ``.idx`` header.
DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def best_dtype(vocab_size: int | None) -> type[np.generic]:
    """The dtype Megatron's writers pick: uint16 below 65500 tokens, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def dataset_exists(prefix: str | os.PathLike) -> bool:
    """True when both ``PREFIX.bin`` and ``PREFIX.idx`` exist."""
    return os.path.isfile(bin_path(prefix)) and os.path.isfile(idx_path(prefix))


def _dtype_code(dtype) -> int:
    try:
        return _CODE_OF_DTYPE[np.dtype(dtype)]
    except (KeyError, TypeError):
        known = ", ".join(np.dtype(t).name for t in DTYPE_CODES.values())
        raise ValueError(f"unsupported indexed dataset dtype {dtype!r}; use one of: {known}") from None


def _sequence_pointers(lengths: np.ndarray, itemsize: int) -> np.ndarray:
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= itemsize
    return pointers


def write_index_file(
    path: str | os.PathLike,
    dtype,
    sequence_lengths: Sequence[int] | np.ndarray,
    document_indices: Sequence[int] | np.ndarray,
) -> None:
    """Write one ``.idx`` file (not atomically; :class:`IndexedDatasetWriter` handles naming)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    docs = np.asarray(document_indices, dtype=np.int64)
    pointers = _sequence_pointers(lengths, dtype.itemsize)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", _dtype_code(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(lengths.astype("<i4", copy=False).tobytes(order="C"))
        f.write(pointers.astype("<i8", copy=False).tobytes(order="C"))
        f.write(docs.astype("<i8", copy=False).tobytes(order="C"))


#: Index entries checked per vectorised step: bounds the temporary arrays (a few x 8 MiB).
_CHECK_CHUNK = 1 << 20


def _validate_sequences(idx_file: str, lengths: np.ndarray, pointers: np.ndarray, dtype: np.dtype) -> None:
    """Refuse an index whose sequences do not tile the ``.bin`` back to back from byte 0.

    Sequence ``i`` must have a non-negative length and start where sequence ``i-1`` ends
    (``pointers[i] == pointers[i-1] + lengths[i-1] * itemsize``, ``pointers[0] == 0``); otherwise
    one sequence would read another's tokens. Checked in chunks straight from the memory map.
    """
    n = len(lengths)
    if n == 0:
        return
    itemsize = dtype.itemsize
    if int(pointers[0]) != 0:
        raise ValueError(
            f"{idx_file}: corrupt index: sequence 0 starts at byte {int(pointers[0])} of the .bin, "
            "expected 0 (the sequences must follow each other from the start of the data)"
        )
    for start in range(0, n, _CHECK_CHUNK):
        stop = min(start + _CHECK_CHUNK, n)
        chunk_lengths = lengths[start:stop]
        negative = chunk_lengths < 0
        # ends[j]: the byte where sequence start+j ends, i.e. where sequence start+j+1 must start.
        ends = chunk_lengths.astype(np.int64)
        ends *= itemsize
        ends += pointers[start:stop]
        follows = pointers[start + 1 : stop + 1]
        mismatch = np.zeros(stop - start, dtype=bool)
        np.not_equal(ends[: len(follows)], follows, out=mismatch[: len(follows)])
        mismatch |= ends < 0  # int64 wrap-around of crafted huge pointers
        bad = negative | mismatch
        if not bad.any():
            continue
        j = int(np.argmax(bad))
        i = start + j
        if negative[j]:
            raise ValueError(
                f"{idx_file}: corrupt index: sequence {i} has negative length {int(chunk_lengths[j])}"
            )
        if int(ends[j]) < 0:
            raise ValueError(
                f"{idx_file}: corrupt index: sequence {i} (at byte {int(pointers[i])}, "
                f"{int(lengths[i])} tokens) ends past the largest possible file offset"
            )
        raise ValueError(
            f"{idx_file}: corrupt index: sequence {i + 1} starts at byte {int(pointers[i + 1])} but "
            f"sequence {i} (at byte {int(pointers[i])}, {int(lengths[i])} tokens of {dtype.name}) ends at "
            f"byte {int(ends[j])}; the sequence lengths and pointers disagree"
        )


def _validate_documents(idx_file: str, documents: np.ndarray, n_seq: int) -> None:
    """Refuse document boundaries that do not run from sequence 0 to ``n_seq`` without going back.

    Equal neighbours are empty documents and valid; several sequences per document are
    sentence-split documents and valid.
    """
    n = len(documents)
    if n == 0:
        raise ValueError(
            f"{idx_file}: corrupt index: it has no document boundaries (expected at least the boundary 0)"
        )
    if int(documents[0]) != 0:
        raise ValueError(
            f"{idx_file}: corrupt index: document boundary 0 is {int(documents[0])}, expected 0"
        )
    if int(documents[-1]) != n_seq:
        raise ValueError(
            f"{idx_file}: corrupt index: the last document boundary ({n - 1}) is {int(documents[-1])} "
            f"but the index has {n_seq} sequences (the boundaries must end at the number of sequences)"
        )
    for start in range(0, n - 1, _CHECK_CHUNK):
        stop = min(start + _CHECK_CHUNK, n - 1)
        decreasing = documents[start + 1 : stop + 1] < documents[start:stop]
        if decreasing.any():
            i = start + int(np.argmax(decreasing)) + 1
            raise ValueError(
                f"{idx_file}: corrupt index: document boundary {i} is {int(documents[i])}, below "
                f"boundary {i - 1} ({int(documents[i - 1])}); the boundaries must not decrease"
            )


class IndexedDataset:
    """Read-only, memory-mapped view of a ``PREFIX.bin`` / ``PREFIX.idx`` pair.

    ``ds[i]`` returns sequence ``i`` as a numpy array that shares memory with the file;
    ``ds.get(i, offset, length)`` returns part of it, also without copying.

    Opening validates the whole index (header, sizes, every pointer against the lengths, the
    document boundaries) and raises a one-line ``ValueError`` naming the file and the first
    offending entry, so no sequence can ever read bytes outside its own.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        idx_file, bin_file = idx_path(self.prefix), bin_path(self.prefix)
        missing = [p for p in (idx_file, bin_file) if not os.path.isfile(p)]
        if missing:
            raise ValueError(
                f"indexed dataset {self.prefix!r}: missing file(s) {', '.join(missing)} "
                "(a dataset prefix needs both PREFIX.bin and PREFIX.idx)"
            )
        self._read_index(idx_file)
        self._check_bin(idx_file, bin_file)
        if self._bin_size == 0:
            self._bin = np.zeros(0, dtype=self.dtype)
        else:
            self._bin = np.memmap(bin_file, dtype=self.dtype, mode="r")

    def _read_index(self, idx_file: str) -> None:
        size = os.path.getsize(idx_file)
        with open(idx_file, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE or header[: len(MAGIC)] != MAGIC:
            raise ValueError(
                f"{idx_file}: not a Megatron indexed dataset index (bad magic; expected "
                f"{MAGIC!r} at offset 0)"
            )
        (version,) = struct.unpack_from("<Q", header, 9)
        if version != VERSION:
            raise ValueError(f"{idx_file}: unsupported index version {version} (expected {VERSION})")
        (code,) = struct.unpack_from("<B", header, 17)
        if code not in DTYPE_CODES:
            raise ValueError(
                f"{idx_file}: unknown dtype code {code} (known codes: {sorted(DTYPE_CODES)})"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        (n_seq,) = struct.unpack_from("<Q", header, 18)
        (n_doc,) = struct.unpack_from("<Q", header, 26)
        expected = HEADER_SIZE + 12 * n_seq + 8 * n_doc
        if size != expected:
            raise ValueError(
                f"{idx_file}: file is {size} bytes but its header ({n_seq} sequences, "
                f"{n_doc} document boundaries) needs {expected} bytes; the file is truncated or corrupt"
            )
        if size == HEADER_SIZE:
            buf = np.zeros(0, dtype=np.uint8)
        else:
            buf = np.memmap(idx_file, dtype=np.uint8, mode="r")
        self._idx_buffer = buf
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=n_seq, offset=HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(
            buf, dtype="<i8", count=n_seq, offset=HEADER_SIZE + 4 * n_seq
        )
        self.document_indices = np.frombuffer(
            buf, dtype="<i8", count=n_doc, offset=HEADER_SIZE + 12 * n_seq
        )
        _validate_sequences(idx_file, self.sequence_lengths, self.sequence_pointers, self.dtype)
        _validate_documents(idx_file, self.document_indices, n_seq)

    def _check_bin(self, idx_file: str, bin_file: str) -> None:
        self._bin_size = os.path.getsize(bin_file)
        n = len(self.sequence_lengths)
        if n:  # the pointers are validated: the last sequence ends where the data ends
            expected = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        else:
            expected = 0
        if self._bin_size != expected:
            raise ValueError(
                f"{bin_file} is {self._bin_size} bytes but {idx_file} describes {expected} bytes "
                f"({n} sequences of {self.dtype.name}); the two files do not belong together "
                "or one of them is truncated"
            )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    @property
    def num_tokens(self) -> int:
        return self._bin_size // self.dtype.itemsize

    def _check_index(self, idx: int) -> int:
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences in {self.prefix}")
        return idx

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("IndexedDataset slices must be contiguous (step 1)")
            if start >= stop:
                return []
            ptr = int(self.sequence_pointers[start]) // self.dtype.itemsize
            lengths = self.sequence_lengths[start:stop]
            flat = self._bin[ptr : ptr + int(lengths.sum(dtype=np.int64))]
            return np.split(flat, np.cumsum(lengths[:-1], dtype=np.int64))
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``idx`` as a zero-copy numpy view."""
        idx = self._check_index(idx)
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"slice offset={offset} length={length} outside sequence {idx} of length {seq_len}"
            )
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self._bin[start : start + length]

    def __iter__(self):
        for i in range(len(self)):
            yield self.get(i)

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, dtype={self.dtype.name}, sequences={len(self)}, "
            f"documents={self.num_documents})"
        )


class IndexedDatasetWriter:
    """Builds a ``PREFIX.bin`` / ``PREFIX.idx`` pair.

    Data goes to temporary files beside the final ones; :meth:`finalize` writes the index and
    renames both. Used as a context manager, an exception (or Ctrl-C) inside the block removes
    the temporary files and leaves nothing under the final names::

        with IndexedDatasetWriter("out/corpus_text_document", np.uint16) as w:
            w.add_document([1, 2, 3])
        # finalize() is called on a clean exit
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.int32):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        _dtype_code(self.dtype)  # validate early
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            self._min, self._max = int(info.min), int(info.max)
        else:
            self._min = self._max = None
        parent = os.path.dirname(os.path.abspath(self.prefix))
        if not os.path.isdir(parent):
            raise ValueError(f"output directory {parent} for prefix {self.prefix!r} does not exist")
        self._tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tmp_bin = bin_path(self.prefix) + self._tag
        self._tmp_idx = idx_path(self.prefix) + self._tag
        #: every path this writer made (temporary files, kept previous pairs), removed by abort
        self._created: list[str] = []
        self._published: list[str] = []  # final names replaced by publish(), undone by abort()
        self._backups: dict[str, str] = {}  # final name -> hard link to the file it replaced
        self._state = "closed"  # open -> prepared -> published -> closed
        self._bin_file = open(self._tmp_bin, "xb")
        self._created.append(self._tmp_bin)
        self._state = "open"
        self._lengths: list[int] = []
        self._length_arrays: list[np.ndarray] = []
        self._documents: list[int] = [0]
        self._n_sequences = 0

    # -- adding data --------------------------------------------------------------------
    def _as_array(self, ids) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.size and self._min is not None:
            if arr.dtype.kind not in "iub":
                raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._min or hi > self._max:
                bad = lo if lo < self._min else hi
                raise ValueError(
                    f"token id {bad} does not fit the dataset dtype {self.dtype.name} "
                    f"(range {self._min}..{self._max}) for {self.prefix}; "
                    "use a wider dtype (int32 for vocabularies of 65500 tokens or more)"
                )
        return arr.astype(self.dtype.newbyteorder("<"), copy=False)

    def _write(self, arr: np.ndarray) -> None:
        if self._state != "open":
            raise ValueError(f"writer for {self.prefix} is already finalized or aborted")
        if arr.size:
            self._bin_file.write(arr.tobytes(order="C"))

    def add_item(self, ids) -> None:
        """Append one sequence without closing the document (see :meth:`end_document`)."""
        arr = self._as_array(ids)
        self._write(arr)
        self._lengths.append(int(arr.size))
        self._n_sequences += 1

    def end_document(self) -> None:
        """Close the current document: a boundary after the sequences added so far."""
        self._documents.append(self._n_sequences)

    def add_document(self, ids, lengths: Sequence[int] | None = None) -> None:
        """Append one document.

        Without ``lengths`` the document is one sequence. With ``lengths`` the ids are
        split into sequences of those lengths (Megatron's ``add_document(tensor, lengths)``);
        an empty ``lengths`` adds an empty document (a repeated boundary), as Megatron does.
        """
        arr = self._as_array(ids)
        if lengths is None:
            lengths = [int(arr.size)]
        else:
            lengths = [int(n) for n in lengths]
            if sum(lengths) != arr.size or any(n < 0 for n in lengths):
                raise ValueError(
                    f"sequence lengths {lengths} do not add up to the {arr.size} ids of the document"
                )
        self._write(arr)
        self._lengths.extend(lengths)
        self._n_sequences += len(lengths)
        self._documents.append(self._n_sequences)

    def add_documents(self, ids, sequence_lengths, sequences_per_document) -> None:
        """Append many documents at once (the bulk form used by preprocessing).

        ``ids`` are all tokens concatenated, ``sequence_lengths`` the length of every
        sequence, ``sequences_per_document`` how many sequences each document has (0 for an
        empty document).
        """
        arr = self._as_array(ids)
        lengths = np.asarray(sequence_lengths, dtype=np.int64).reshape(-1)
        per_doc = np.asarray(sequences_per_document, dtype=np.int64).reshape(-1)
        if (
            int(lengths.sum()) != arr.size
            or int(per_doc.sum()) != lengths.size
            or (lengths.size and int(lengths.min()) < 0)
            or (per_doc.size and int(per_doc.min()) < 0)
        ):
            raise ValueError(
                f"inconsistent bulk add: {arr.size} ids, {lengths.size} sequences summing to "
                f"{int(lengths.sum())}, documents covering {int(per_doc.sum())} sequences"
            )
        self._write(arr)
        self._flush_lengths()
        self._length_arrays.append(lengths.astype(np.int32))
        self._documents.extend((self._n_sequences + np.cumsum(per_doc)).tolist())
        self._n_sequences += int(lengths.size)

    def add_sequences_as_document(self, sequences: Iterable) -> None:
        """Append several sequences (e.g. sentences) forming one document."""
        arrays = [self._as_array(s) for s in sequences]
        for arr in arrays:
            self._write(arr)
            self._lengths.append(int(arr.size))
        self._n_sequences += len(arrays)
        self._documents.append(self._n_sequences)

    def add_index(self, other_prefix: str | os.PathLike) -> None:
        """Append every sequence and document of another dataset (same dtype) to this one."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise ValueError(
                f"cannot merge {other.prefix} (dtype {other.dtype.name}) into {self.prefix} "
                f"(dtype {self.dtype.name}): all datasets must share one dtype"
            )
        if self._state != "open":
            raise ValueError(f"writer for {self.prefix} is already finalized or aborted")
        offset = self._n_sequences
        self._flush_lengths()
        self._length_arrays.append(np.array(other.sequence_lengths, dtype=np.int32))
        self._n_sequences += len(other)
        docs = np.asarray(other.document_indices, dtype=np.int64)
        self._documents.extend((docs[1:] + offset).tolist())
        with open(bin_path(other.prefix), "rb") as src:
            shutil.copyfileobj(src, self._bin_file, 16 * 1024 * 1024)
        del other

    def _flush_lengths(self) -> None:
        if self._lengths:
            self._length_arrays.append(np.asarray(self._lengths, dtype=np.int32))
            self._lengths = []

    # -- finishing ----------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return self._n_sequences

    def finalize(self) -> str:
        """Write the index and move both files to their final names; returns the prefix."""
        self.prepare()
        self.publish()
        self.commit()
        return self.prefix

    def prepare(self) -> None:
        """Make both files complete and durable under their temporary names (nothing final yet)."""
        if self._state != "open":
            raise ValueError(f"writer for {self.prefix} is already finalized or aborted")
        try:
            self._bin_file.flush()
            os.fsync(self._bin_file.fileno())
            self._bin_file.close()
            self._flush_lengths()
            lengths = (
                np.concatenate(self._length_arrays) if self._length_arrays else np.zeros(0, np.int32)
            )
            self._created.append(self._tmp_idx)
            write_index_file(self._tmp_idx, self.dtype, lengths, self._documents)
            with open(self._tmp_idx, "rb") as f:
                os.fsync(f.fileno())
        except BaseException:
            self.abort()
            raise
        self._state = "prepared"

    def publish(self) -> None:
        """Rename the prepared pair to ``PREFIX.bin`` / ``PREFIX.idx``, ``.bin`` first.

        Two names cannot be replaced in one atomic step, so the order decides what a reader
        can see in between. ``.bin`` goes first and ``.idx`` last, so the ``.idx`` is the
        commit point:

        * a new prefix: until the ``.idx`` appears the dataset does not exist (readers and
          ``dataset_exists`` need both files), and once it exists its ``.bin`` is final. The
          other order would show a complete-looking ``.idx`` with no ``.bin`` behind it.
        * replacing a pair: a reader opening between the two renames pairs the old ``.idx``
          with the new ``.bin`` (the other order gives the new ``.idx`` with the old ``.bin``;
          neither order avoids a mixed pair). `IndexedDataset` compares the ``.bin`` size with
          the one the ``.idx`` describes and refuses the pair; only a replacement of exactly
          the same byte size can pass, which is why writers of one prefix are serialised by a
          lock (preprocessing takes ``PREFIX.lock``) and why a prefix should not be read while
          it is being regenerated.

        Existing files under the final names are kept as hard links until :meth:`commit`, so
        :meth:`abort` after a publish puts the previous pair back.
        """
        if self._state != "prepared":
            raise ValueError(f"writer for {self.prefix} is not prepared (call prepare() first)")
        self._state = "publishing"
        try:
            for final in (bin_path(self.prefix), idx_path(self.prefix)):
                if os.path.lexists(final) and not os.path.isdir(final):
                    backup = final + self._tag.replace(".tmp-", ".old-")
                    try:
                        os.link(final, backup, follow_symlinks=False)
                    except OSError:
                        continue  # no hard links here: an abort can only remove what we published
                    self._created.append(backup)
                    self._backups[final] = backup
            for tmp, final in ((self._tmp_bin, bin_path(self.prefix)), (self._tmp_idx, idx_path(self.prefix))):
                os.replace(tmp, final)
                self._created.remove(tmp)
                self._published.append(final)
        except BaseException:
            self.abort()
            raise
        self._state = "published"

    @property
    def is_published(self) -> bool:
        """Published under the final names and not yet committed (an abort would undo it)."""
        return self._state == "published"

    def commit(self) -> None:
        """Forget the previous pair kept by :meth:`publish`; the new pair stays."""
        if self._state != "published":
            raise ValueError(f"writer for {self.prefix} is not published")
        self._drop_backups()
        self._published = []
        self._state = "closed"

    def _drop_backups(self) -> None:
        for backup in list(self._backups.values()):
            with contextlib.suppress(FileNotFoundError):
                os.remove(backup)
            self._created.remove(backup)
        self._backups = {}

    def abort(self) -> None:
        """Undo everything this writer did: its temporary files are removed and, after a
        :meth:`publish` not yet committed, the previous pair is put back under the final names
        (or, where there was none, what it published is removed). Files it did not create are
        never touched."""
        self._state = "closed"
        try:
            self._bin_file.close()
        except OSError:
            pass
        for final in reversed(self._published):
            backup = self._backups.pop(final, None)
            if backup is not None:
                self._created.remove(backup)  # the previous file: kept, whatever happens next
                with contextlib.suppress(OSError):
                    os.replace(backup, final)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(final)
        self._published = []
        self._drop_backups()
        for p in self._created:
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
        self._created = []
        self._state = "closed"

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            if self._state == "open":
                self.finalize()
        else:
            self.abort()
        return False

    def __del__(self):
        # A writer dropped without finalize() must not leave temporary files behind.
        if getattr(self, "_state", "closed") != "closed":
            self.abort()
