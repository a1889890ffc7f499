"""Megatron-LM indexed dataset files (``PREFIX.bin`` / ``PREFIX.idx``, the MMIDIDX format).

One module per concern:

* `format` — the layout (described there), the header constants, Megatron's dtype codes,
  ``best_dtype`` and the file names of a prefix;
* `reader` — the memory-mapped reader :class:`IndexedDataset`, which validates the whole index
  when it opens a pair;
* `writer` — the atomic writer :class:`IndexedDatasetWriter` (temporary names, renamed only by
  :meth:`~IndexedDatasetWriter.finalize`; an aborted writer removes only the files it created).

Everything is importable from here: ``from megatrain.data.indexed_dataset import IndexedDataset``.
"""

from __future__ import annotations

from megatrain.data.indexed_dataset.format import (
    DTYPE_CODES,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    best_dtype,
    bin_path,
    dataset_exists,
    idx_path,
)
from megatrain.data.indexed_dataset.reader import IndexedDataset
from megatrain.data.indexed_dataset.writer import IndexedDatasetWriter, write_index_file

__all__ = [
    "DTYPE_CODES",
    "HEADER_SIZE",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "MAGIC",
    "VERSION",
    "best_dtype",
    "bin_path",
    "dataset_exists",
    "idx_path",
    "write_index_file",
]
