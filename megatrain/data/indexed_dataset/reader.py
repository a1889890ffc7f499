"""The memory-mapped reader `IndexedDataset` and the validation of a whole index on open.

Opening a ``PREFIX.bin`` / ``PREFIX.idx`` pair checks the header, the sizes, every sequence pointer
against the lengths and the document boundaries, so no sequence can read bytes outside its own.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from megatrain.data.indexed_dataset.format import DTYPE_CODES, HEADER_SIZE, MAGIC, VERSION, bin_path, idx_path

__all__ = ["IndexedDataset"]


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
