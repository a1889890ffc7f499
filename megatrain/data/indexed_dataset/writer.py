"""The atomic writer `IndexedDatasetWriter` and `write_index_file`.

A writer puts its data under temporary names beside the final ones and renames them only in
:meth:`~IndexedDatasetWriter.finalize` (or in the steps ``prepare`` / ``publish`` / ``commit`` that a
run with several outputs calls to publish them together); an aborted writer removes only the files it
created and puts back what its publish had replaced.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import uuid
from typing import Iterable, Sequence

import numpy as np

from megatrain.data.indexed_dataset.format import MAGIC, VERSION, _dtype_code, bin_path, idx_path
from megatrain.data.indexed_dataset.reader import IndexedDataset

__all__ = ["IndexedDatasetWriter", "write_index_file"]


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
