"""Exact byte-level BPE of texts holding huge pre-tokenized pieces, in bounded time and memory.

A tiktoken encoding splits text with its regex and runs BPE on every piece. A piece is a run
of letters, of digits, of other symbols or of whitespace, so a 50 MB line without spaces is
one 50 MB piece, and tiktoken's BPE of one piece keeps about 50 bytes of state per input byte
and slows down as the piece grows (it is O(n log n) with poor locality): 2.3 GB and over a
minute for 50 MB. :class:`LongPieceEncoder` gives the same token ids with memory and time
proportional to the text and bounded per piece.

Why windows give the exact ids. Say a token sequence is *valid* when it is the BPE of its own
bytes. (1) Any contiguous part of a valid sequence is valid for its bytes: BPE never merged
across the part's edges, and the merges inside a part happen in an order that depends only on
the ranks inside it. (2) If ``A + [t]`` and ``[t] + B`` are valid and ``t`` covers the same
bytes in both, then ``A + [t] + B`` is valid: a first merge across a token edge in the whole
would lie within one of the two sides, whose own merges happen in the same relative order,
so that side would make it too, and it does not. The BPE of a text is its unique valid
sequence. So: encode overlapping windows of the piece, find in the overlap a token that both
windows produce over the same bytes, and join the two encodings at it; the result is the BPE
of the whole piece, not an approximation. (Cutting a piece into chunks without such a check,
as some implementations do, changes the ids next to every cut.)

Windows start at a token boundary of the window before, so their encodings agree from the
first token on in practice; where no common token is found the overlap grows, and in the
end the piece is encoded whole as before (still exact, only slow).

The regex split is tiktoken's own except around huge pieces: there the text is split with the
``regex`` module using the same pattern; the text between huge pieces (whole pieces only) is
encoded by tiktoken in one call, which splits it into the same pieces again.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = ["LONG_PIECE_CHARS", "LongPieceEncoder"]

#: Pieces longer than this many characters are encoded in windows. A text holds such a piece
#: only when it has a run of at least this many non-space (or space) characters.
LONG_PIECE_CHARS = 8192
WINDOW_BYTES = 8192
OVERLAP_BYTES = 512



def _long_run(chars: int) -> re.Pattern:
    # Runs that begin where the previous character is of the other kind: each position is
    # looked at a bounded number of times, so the search is linear in the text.
    return re.compile(r"(?<!\S)\S{%d}|(?<!\s)\s{%d}" % (chars, chars))


_LONG_RUN = _long_run(LONG_PIECE_CHARS)


class LongPieceEncoder:
    """Token ids of a tiktoken ``Encoding`` (ordinary text, no special tokens), computed in
    windows for pieces longer than :data:`LONG_PIECE_CHARS`. ``ranks`` maps token bytes to
    ids (the encoding's mergeable ranks)."""

    def __init__(self, encoding: Any, pattern: str, ranks: dict[bytes, int], *,
                 long_piece_chars: int = LONG_PIECE_CHARS, window_bytes: int = WINDOW_BYTES,
                 overlap_bytes: int = OVERLAP_BYTES):
        assert long_piece_chars >= 1 and window_bytes > 2 * overlap_bytes >= 2
        self.long_piece_chars, self.window_bytes, self.overlap_bytes = long_piece_chars, window_bytes, overlap_bytes
        self._long_run = _LONG_RUN if long_piece_chars == LONG_PIECE_CHARS else _long_run(long_piece_chars)
        #: how often a piece was encoded whole because no window join was found (for tests)
        self.whole_piece_fallbacks = 0
        self._enc = encoding
        self._pattern = pattern
        self._ranks = ranks
        self._split = None
        self._lengths: np.ndarray | None = None
        single = getattr(encoding, "_encode_single_piece", None)
        self._bpe = single if single is not None else encoding._core_bpe.encode_single_piece

    def has_long_piece(self, text: str) -> bool:
        return len(text) > self.long_piece_chars and self._long_run.search(text) is not None

    def encode_to_numpy(self, text: str) -> np.ndarray:
        if not self.has_long_piece(text):
            return self._enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
        return self._encode_split(text)

    def encode(self, text: str) -> list[int]:
        if not self.has_long_piece(text):
            return self._enc.encode_ordinary(text)
        return self._encode_split(text).tolist()

    # -- the slow path ------------------------------------------------------------------
    def _encode_split(self, text: str) -> np.ndarray:
        if self._split is None:
            import regex

            self._split = regex.compile(self._pattern)
            lengths = np.zeros(max(self._ranks.values()) + 1, dtype=np.int64)
            for token, rank in self._ranks.items():
                lengths[rank] = len(token)
            self._lengths = lengths
        parts: list[np.ndarray] = []
        done = 0  # text[:done] is encoded
        for m in self._split.finditer(text):  # lazily: memory stays bounded for any text
            a, b = m.span()
            if b - a > self.long_piece_chars:
                if a > done:
                    parts.append(self._ordinary(text[done:a]))
                parts.append(self._encode_piece(text[a:b].encode("utf-8")))
                done = b
        if done < len(text):
            parts.append(self._ordinary(text[done:]))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)

    def _ordinary(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=()),
                          dtype=np.uint32)

    def _window(self, piece: bytes, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """BPE of ``piece[start:stop]``: token ids and each token's end offset in ``piece``."""
        ids = np.asarray(self._bpe(piece[start:stop]), dtype=np.uint32)
        return ids, start + np.cumsum(self._lengths[ids])

    def _encode_piece(self, piece: bytes) -> np.ndarray:
        n = len(piece)
        if piece in self._ranks:  # as tiktoken: a piece that is a token is that token
            return np.array([self._ranks[piece]], dtype=np.uint32)
        out: list[np.ndarray] = []
        we = min(self.window_bytes, n)
        ids, ends = self._window(piece, 0, we)
        first = 0  # index of this window's first token not emitted yet
        while we < n:
            joined = self._join(piece, ids, ends, first, we)
            if joined is None:  # no common token anywhere in this window: encode the piece whole
                self.whole_piece_fallbacks += 1
                return np.asarray(self._bpe(piece), dtype=np.uint32)
            k, ids2, ends2, k2, we2 = joined
            out.append(ids[first : k + 1])  # up to and including the common token
            ids, ends, first, we = ids2, ends2, k2 + 1, we2
        out.append(ids[first:])
        return np.concatenate(out)

    def _join(self, piece: bytes, ids: np.ndarray, ends: np.ndarray, first: int, we: int):
        """Encode the next window, from a token boundary of this one (``ids``/``ends``, which
        ends at ``we``) to ``WINDOW_BYTES`` further, and find a token both windows produce over
        the same bytes, after this window's emitted tokens (those before ``first``). Returns
        (its index here, the next window's ids and ends, its index there, the next window's
        end), or None when there is none."""
        n = len(piece)
        low = int(ends[first - 1]) if first > 0 else int(ends[0] - self._lengths[ids[0]])
        stop = min(we + self.window_bytes, n)
        overlap = self.overlap_bytes
        while True:
            target = max(we - overlap, low + 1)
            j = min(int(np.searchsorted(ends, target)), len(ends) - 2)  # a token ending at/after target
            if j < 0 or int(ends[j]) <= low:
                return None
            start = int(ends[j])  # the next window starts where token j ends
            ids2, ends2 = self._window(piece, start, stop)
            here = {int(e): i for i, e in enumerate(ends[j + 1 :], start=j + 1)}
            for i2, e2 in enumerate(ends2.tolist()):
                if e2 > we:
                    break
                i = here.get(e2)
                if i is not None and int(ends[i - 1]) == (int(ends2[i2 - 1]) if i2 else start):
                    return i, ids2, ends2, i2, stop
            if target <= low + 1:
                return None
            overlap *= 4
