"""The BERT sample index of Megatron-LM's ``helpers.cpp`` (``build_mapping``), in numpy.

A sample is a run of whole sentences of one document, ``(first sentence, end sentence,
target length)``. For every epoch (until the requested number of samples is reached, checked at
the start of an epoch, so whole epochs are built) and every document in order:

* documents with fewer than ``min_num_sent`` sentences are skipped, and so are documents of
  more than one sentence that hold a sentence longer than ``LONG_SENTENCE_LEN`` (512) tokens;
* a target length is drawn (``std::mt19937(seed)``, one stream over all epochs): with
  ``short_seq_ratio = round(1 / short_seq_prob)``, a draw ``r`` with ``r % ratio == 0`` gives
  ``2 + r % (max_seq_length - 1)``, any other draw ``max_seq_length`` (no draws at all when the
  probability is 0);
* sentences are added until the sample holds at least the target's tokens and at least
  ``min_num_sent`` sentences while at least two sentences of the document remain, or until the
  document ends; then the sample is emitted and the next target drawn (also after the
  document's last sample, whose draw is never used).

Finally the samples are shuffled by Fisher-Yates with ``std::mt19937_64(seed + 1)``: for
``i = N-1 .. 1`` swap ``i`` with ``rand64() % (i + 1)``.

The sentence loop is written by segments: where a sample ends follows from the cumulative
sentence lengths by ``searchsorted``. Every document's samples when all targets are the full
length are computed for all documents at once; a document whose used draws are all full-length
(the common case; all of them when the probability is 0) takes those samples, and only a
document that meets a short draw is walked sample by sample. The result is the same array, in the
same order, as the C++ loops.
"""

from __future__ import annotations

import array
import math
from bisect import bisect_left, bisect_right
from typing import Optional

import numpy as np

from megatrain.data.mt19937 import MT19937, MT19937_64

__all__ = ["LONG_SENTENCE_LEN", "NoSamplesError", "build_mapping", "eligible_documents",
           "short_seq_ratio", "shuffle_rows"]

LONG_SENTENCE_LEN = 512


class NoSamplesError(ValueError):
    """No document can give a sample (Megatron's loop over epochs would never end)."""


def short_seq_ratio(short_seq_prob: float) -> int:
    """``static_cast<int32_t>(round(1.0 / p))`` (C rounds halves away from zero); 0 for p == 0."""
    if short_seq_prob <= 0:
        return 0
    return int(math.floor(1.0 / short_seq_prob + 0.5))


def eligible_documents(docs: np.ndarray, sizes: np.ndarray, min_num_sent: int) -> np.ndarray:
    """Boolean per document (``docs`` are boundaries): can it give samples?"""
    docs = np.asarray(docs, dtype=np.int64)
    counts = docs[1:] - docs[:-1]
    long_cum = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(np.asarray(sizes) > LONG_SENTENCE_LEN, out=long_cum[1:])
    has_long = (long_cum[docs[1:]] - long_cum[docs[:-1]]) > 0
    return (counts >= min_num_sent) & ~((counts > 1) & has_long)


class _Stream:
    """The ``std::mt19937`` stream of target lengths, held from the current position on."""

    def __init__(self, seed: int, ratio: int, max_len: int):
        self._gen = MT19937(seed)
        self.ratio = ratio
        self.max_len = max_len
        self.base = 0
        self.values = np.zeros(0, dtype=np.uint32)

    def window(self, pos: int, count: int) -> tuple[list, list]:
        """Targets of draws ``[pos, pos + count)`` and the offsets of the short ones among them."""
        drop = min(pos - self.base, len(self.values))
        self.values = self.values[drop:]
        self.base += drop
        have = self.base + len(self.values)
        if pos + count > have:
            more = self._gen.take(pos + count - have)
            self.values = np.concatenate((self.values, more))
        r = self.values[pos - self.base:pos - self.base + count].astype(np.int64)
        short = r % self.ratio == 0
        targets = np.where(short, 2 + r % (self.max_len - 1), self.max_len)
        return targets.tolist(), np.flatnonzero(short).tolist()


def _next_ends(cum: np.ndarray, first: np.ndarray, last: np.ndarray, max_len: int,
               min_num_sent: int) -> np.ndarray:
    """For every sentence of the documents ``[first, last)``: where a sample starting there
    ends when its target is ``max_len`` (-1 for sentences outside those documents)."""
    out = np.full(cum.shape[0] - 1, -1, dtype=np.int64)
    counts = last - first
    if counts.sum() == 0:
        return out
    starts = np.repeat(first - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    starts += np.arange(counts.sum(), dtype=np.int64)
    doc_last = np.repeat(last, counts)
    end_incl = np.searchsorted(cum, cum[starts] + max_len, side="left") - 1
    end_incl = np.maximum(end_incl, starts + (min_num_sent - 1))
    out[starts] = np.where(end_incl <= doc_last - 3, end_incl + 1, doc_last)
    return out


def _full_length_segments(next_end: np.ndarray, first: np.ndarray, last: np.ndarray):
    """Samples of every document when all targets are the full length: (starts, ends, offsets)."""
    num_docs = len(first)
    rows_doc, rows_round, rows_start, rows_end = [], [], [], []
    active = np.arange(num_docs, dtype=np.int64)
    start = first.copy()
    rnd = 0
    while active.size:
        s = start[active]
        end = next_end[s]
        rows_doc.append(active)
        rows_round.append(np.full(active.size, rnd, dtype=np.int64))
        rows_start.append(s)
        rows_end.append(end)
        start[active] = end
        active = active[end < last[active]]
        rnd += 1
    if not rows_doc:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(num_docs + 1, dtype=np.int64)
    doc = np.concatenate(rows_doc)
    counts = np.bincount(doc, minlength=num_docs)
    offsets = np.zeros(num_docs + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    where = offsets[doc] + np.concatenate(rows_round)
    starts = np.empty(len(doc), dtype=np.int64)
    ends = np.empty(len(doc), dtype=np.int64)
    starts[where] = np.concatenate(rows_start)
    ends[where] = np.concatenate(rows_end)
    return starts, ends, offsets


def shuffle_rows(num_rows: int, seed: int) -> np.ndarray:
    """The permutation of helpers.cpp's Fisher-Yates shuffle with ``std::mt19937_64(seed)``."""
    if num_rows < 2:
        return np.arange(num_rows, dtype=np.int64)
    perm = array.array("q", range(num_rows))
    gen = MT19937_64(seed)
    chunk = 1 << 20
    i = num_rows - 1
    while i > 0:
        k = min(chunk, i)
        bounds = np.arange(i + 1, i + 1 - k, -1, dtype=np.int64).astype(np.uint64)
        js = (gen.take(k) % bounds).tolist()
        for ii, j in zip(range(i, i - k, -1), js):
            perm[ii], perm[j] = perm[j], perm[ii]
        i -= k
    return np.frombuffer(perm, dtype=np.int64)


def build_mapping(docs: np.ndarray, sizes: np.ndarray, max_num_samples: Optional[int],
                  max_seq_length: int, short_seq_prob: float, seed: int,
                  min_num_sent: int) -> np.ndarray:
    """helpers.cpp ``build_mapping``: ``[N, 3]`` rows (first sentence, end sentence, target length).

    ``docs``: the document boundaries (sentence indices) of the documents to use, as Megatron
    passes them (``document_indices[indices + [last + 1]]``); ``sizes``: every sentence's length.
    ``max_num_samples`` None builds one epoch. Rows are uint32 (uint64 for more than 2**32
    sentences), shuffled. Raises `NoSamplesError` when samples are needed but no document can
    give one (Megatron would loop without end).
    """
    if max_seq_length <= 1:
        raise ValueError(f"the maximum sample length must be greater than 1, got {max_seq_length}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ValueError(f"--short-seq-prob must be in [0, 1], got {short_seq_prob}")
    docs = np.asarray(docs, dtype=np.int64)
    sizes = np.asarray(sizes)
    dtype = np.uint64 if sizes.size > np.iinfo(np.uint32).max else np.uint32
    ok = eligible_documents(docs, sizes, min_num_sent)
    first, last = docs[:-1][ok], docs[1:][ok]
    if max_num_samples is not None and max_num_samples <= 0:
        return np.zeros((0, 3), dtype=dtype)
    if first.size == 0:
        raise NoSamplesError(f"no document has at least {min_num_sent} sentence(s) without a "
                             f"sentence longer than {LONG_SENTENCE_LEN} tokens")
    cum = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, dtype=np.int64, out=cum[1:])
    next_end = _next_ends(cum, first, last, max_seq_length, min_num_sent)
    seg_start, seg_end, seg_off = _full_length_segments(next_end, first, last)
    full_epoch = np.stack([seg_start, seg_end, np.full(seg_start.size, max_seq_length, np.int64)], 1)
    ratio = short_seq_ratio(short_seq_prob)
    if ratio:
        walker = _EpochWalker(cum, next_end, first, last, seg_off, full_epoch, min_num_sent,
                              _Stream(seed, ratio, max_seq_length))
    epochs: list[np.ndarray] = []
    total = 0

    def more_epochs() -> bool:  # checked at an epoch's start, as in helpers.cpp
        return not epochs if max_num_samples is None else total < max_num_samples

    while more_epochs():
        epoch = walker.epoch() if ratio else full_epoch
        epochs.append(epoch)
        total += epoch.shape[0]
    maps = np.concatenate(epochs) if len(epochs) > 1 else epochs[0]
    perm = shuffle_rows(maps.shape[0], seed + 1)
    return maps[perm].astype(dtype)


class _EpochWalker:
    """One epoch's samples when targets are drawn: documents whose used draws are all full-length
    take their precomputed samples in bulk; a document meeting a short draw is walked."""

    def __init__(self, cum, next_end, first, last, seg_off, full_epoch, min_num_sent, stream):
        self.cum = cum.tolist()
        self.next_end = next_end.tolist()
        self.first, self.last = first.tolist(), last.tolist()
        self.seg_off = seg_off
        self.full_epoch = full_epoch
        self.min_num_sent = min_num_sent
        self.stream = stream
        self.max_len = stream.max_len
        # Draws each document uses with full-length targets: one per sample plus the unused last.
        self.draw_off = np.concatenate(([0], np.cumsum(np.diff(seg_off) + 1))).tolist()
        # At most one draw per sentence plus one per document.
        self.bound = int((last - first).sum() + first.size)
        self.pos = 0

    def _walk(self, d: int, tg: list, p: int, rows: list) -> int:
        """Document ``d`` from window draw ``p``: append its rows, return the next draw."""
        cum, nxt, m, max_len = self.cum, self.next_end, self.min_num_sent, self.max_len
        s, l = self.first[d], self.last[d]
        t = tg[p]
        p += 1
        while True:
            if t == max_len:
                end = nxt[s]
            else:
                e = max(bisect_left(cum, cum[s] + t) - 1, s + m - 1)
                end = e + 1 if e <= l - 3 else l
            rows.append((s, end, t))
            t = tg[p]
            p += 1
            s = end
            if s >= l:
                return p

    def epoch(self) -> np.ndarray:
        tg, shorts = self.stream.window(self.pos, self.bound)
        num_docs = len(self.first)
        draw_off, seg_off, full = self.draw_off, self.seg_off.tolist(), self.full_epoch
        walked: list = []  # rows of the walked documents, in order
        los, his = [], []  # the epoch as ranges of rows of `full` followed by `walked`
        base = full.shape[0]
        d, p, k = 0, 0, 0  # document, draw in the window, next short draw in `shorts`
        while d < num_docs:
            rest_end = p + draw_off[num_docs] - draw_off[d]
            k = bisect_left(shorts, p, k)
            if k == len(shorts) or shorts[k] >= rest_end:  # no short draw in the rest
                los.append(seg_off[d])
                his.append(base)
                p = rest_end
                break
            s = shorts[k]
            d2 = bisect_right(draw_off, s - p + draw_off[d]) - 1
            doc_p = p + draw_off[d2] - draw_off[d]
            if s == doc_p + draw_off[d2 + 1] - draw_off[d2] - 1:  # the unused last draw only
                los.append(seg_off[d])
                his.append(seg_off[d2 + 1])
                p, d = s + 1, d2 + 1
                continue
            los.append(seg_off[d])
            his.append(seg_off[d2])
            los.append(base + len(walked))
            p = self._walk(d2, tg, doc_p, walked)
            his.append(base + len(walked))
            d = d2 + 1
        self.pos += p
        rows = np.concatenate((full, np.asarray(walked, dtype=np.int64).reshape(-1, 3)))
        lo, hi = np.asarray(los, dtype=np.int64), np.asarray(his, dtype=np.int64)
        lengths = hi - lo
        before = np.cumsum(lengths) - lengths
        take = np.repeat(lo - before, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
        return rows[take]
