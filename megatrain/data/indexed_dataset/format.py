"""The Megatron-LM indexed dataset format (``PREFIX.bin`` / ``PREFIX.idx``, MMIDIDX): its constants,
dtype codes and file names.

``.bin`` holds token ids back to back with no header. ``.idx`` (little-endian) holds:

    magic b"MMIDIDX\\x00\\x00" | <Q version=1 | <B dtype code | <Q S sequences | <Q D boundaries
    int32[S] sequence lengths | int64[S] sequence byte offsets | int64[D] document boundaries

A *sequence* is a run of tokens (one document, or one sentence with ``--split-sentences``);
``document_indices`` lists, for every document boundary, the index of the first sequence after
it, from 0 to S. Files written by this package are byte-identical to Megatron-LM's for the same ids.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = [
    "DTYPE_CODES",
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
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
