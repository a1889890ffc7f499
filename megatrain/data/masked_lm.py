"""Megatron-LM's masked-LM masking (``masked_dataset._create_masked_lm_predictions``) and one BERT
sample as ``BERTMaskedWordPieceDataset.__getitem__`` forms it.

`mask_tokens` is the masking BERT and T5 share: whole words by ``##`` pieces, no permutation, and
either n-grams of up to ``max_ngram`` words with probabilities proportional to 1/n (BERT:
``max_ngram`` 3) or a span length ``min(geometric(0.2), max_ngram)`` (T5, SpanBERT's: ``max_ngram``
10). The candidate words are shuffled; for each, n is drawn, shortened while the n-gram would
overshoot ``min(mask_prob * target, max(1, round(len * mask_prob)))`` masked tokens, skipped if it
overlaps a masked one. Each masked token becomes what ``replace`` says: BERT's [MASK] (80%), a
random id of the sorted vocabulary (10%) or itself (10%); T5's always [MASK] (no draw). It returns
the masked tokens, the masked positions and ids, and the masked spans (one per chosen n-gram,
sorted by their first position) that T5 replaces by sentinels.

A BERT sample (`bert_sample`), given the sentences of a sample-index row, its target length and
the random state ``numpy.random.RandomState((seed + idx) % 2**32)``, in this order of random draws:

1. with the binary head: the pivot between segments A and B (``randint(1, n)`` when there are
   at least three sentences, else 1) and the swap of A and B (``random() < 0.5``: ``is_random``);
2. truncation to the target length: while too long, the longer segment (B on a tie) loses its
   first token when ``random() < 0.5``, else its last (``truncated``);
3. ``[CLS] A [SEP] B [SEP]`` (``[CLS] A [SEP]`` without B), token types 0 for A, 1 for B;
4. masking (`mask_tokens`, ``max_ngram`` 3, BERT's replacement);
5. padding to ``seq_length`` with the pad id, labels -1 except at masked positions,
   ``padding_mask`` 1 except where the token is the pad id (there: the pad id), ``loss_mask``
   1 at masked positions, then pad ids in ``text`` and ``labels`` become 0.

The random draws are the same calls in the same order as Megatron's (a block of
``random_sample`` draws where Megatron draws one by one in a loop, ``shuffle`` of an index array
for the shuffle of the candidate list, the inverse-CDF step of ``choice``, ``geometric`` itself),
so the samples are identical. (Megatron shuffles the candidates once more after masking; nothing
draws from the random state after that, so it is left out.)
"""

from __future__ import annotations

import warnings
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Sequence

import numpy as np

__all__ = ["GEOMETRIC_P", "MASKING_MAX_NGRAM", "Masked", "WordPieceTables", "bert_sample", "mask_tokens",
           "pad_token_id", "wordpiece_tables"]

#: Megatron's ``pretrain_bert.py`` settings (``masking_max_ngram=3``, full words, no permutation).
MASKING_MAX_NGRAM = 3
#: The success probability of the geometric span-length distribution (SpanBERT's, Megatron's).
GEOMETRIC_P = 0.2
_PAD_TOKEN_ID = -1


@lru_cache(maxsize=None)
def _ngram_cdf(max_ngram: int) -> tuple[float, ...]:
    """The cumulative distribution ``RandomState.choice`` searches for n = 1..max_ngram."""
    nvals = np.arange(max_ngram, dtype=np.int64) + 1
    nprobs = 1.0 / nvals
    nprobs = nprobs / nprobs.sum(keepdims=True)
    p = nprobs[:max_ngram] / nprobs[:max_ngram].sum(keepdims=True)
    cdf = p.cumsum()
    cdf /= cdf[-1]
    return tuple(cdf.tolist())


def pad_token_id(tokenizer) -> int:
    """Megatron's ``MegatronDataset`` pad id: ``tokenizer.pad``, or -1 when it has none or when it
    equals another special token (``special_tokens_dict`` when the tokenizer has one, else eos and
    eod)."""
    try:
        pad = tokenizer.pad
    except Exception:
        return _PAD_TOKEN_ID
    if pad is None:
        return _PAD_TOKEN_ID
    try:
        specials = [v for k, v in tokenizer.special_tokens_dict.items() if k != "pad_token"]
    except (AttributeError, IndexError, ValueError):
        specials = []
    if not specials:
        for name in ("eos", "eod"):
            try:
                specials.append(getattr(tokenizer, name))
            except (AttributeError, NotImplementedError):
                pass
    if pad in specials:
        warnings.warn("The pad token id of the tokenizer collides with another special token id; "
                      "samples are padded with -1 instead (as Megatron-LM does)", stacklevel=2)
        return _PAD_TOKEN_ID
    return int(pad)


@dataclass
class WordPieceTables:
    """What the sampler needs of the tokenizer, as arrays."""

    cls: int
    sep: int
    mask: int
    pad: int  # after Megatron's collision rule
    is_subword: np.ndarray  # bool per id: the piece starts with "##"
    known: np.ndarray  # bool per id: the id is in the vocabulary
    token_lookup: list  # sorted(inv_vocab)


def wordpiece_tables(tokenizer) -> WordPieceTables:
    inv = tokenizer.inv_vocab
    ids = sorted(int(i) for i in inv)
    size = (ids[-1] + 1) if ids else 0
    is_subword = np.zeros(size, dtype=bool)
    known = np.zeros(size, dtype=bool)
    for i in ids:
        known[i] = True
        is_subword[i] = str(inv[i]).startswith("##")
    return WordPieceTables(cls=int(tokenizer.cls), sep=int(tokenizer.sep), mask=int(tokenizer.mask),
                           pad=pad_token_id(tokenizer), is_subword=is_subword, known=known,
                           token_lookup=sorted(inv.keys()))


def _truncate(a: np.ndarray, b: np.ndarray, target: int, rng: np.random.RandomState):
    """Megatron's trimming loop in closed form (same draws, same result)."""
    la, lb = a.shape[0], b.shape[0]
    excess = la + lb - target
    if excess <= 0:
        return a, b, False
    u = rng.random_sample(excess)
    # Step by step the longer segment loses a token (B on a tie): first the difference, then B, A,
    # B, A, ... alternately.
    on_a = np.zeros(excess, dtype=bool)
    first = min(excess, abs(la - lb))
    if la > lb:
        on_a[:first] = True
    on_a[first + 1::2] = True
    front = u < 0.5
    a_front, a_back = int(np.sum(on_a & front)), int(np.sum(on_a & ~front))
    b_front, b_back = int(np.sum(~on_a & front)), int(np.sum(~on_a & ~front))
    return a[a_front:la - a_back], b[b_front:lb - b_back], True


class Masked(NamedTuple):
    """What `mask_tokens` returns."""

    tokens: np.ndarray  # the tokens with the masked ones replaced
    positions: np.ndarray  # the masked positions, ascending
    labels: np.ndarray  # the original ids there
    spans: list  # per chosen n-gram its positions (a list), sorted by the first position


def _check_known(tokens: np.ndarray, tables: WordPieceTables) -> None:
    if tokens.size and (int(tokens.max()) >= tables.known.shape[0] or int(tokens.min()) < 0
                        or not tables.known[tokens].all()):
        bad = next(int(t) for t in tokens if not 0 <= t < tables.known.shape[0] or not tables.known[t])
        raise ValueError(f"token id {bad} is not in the tokenizer's vocabulary: was the data "
                         "preprocessed with this --vocab-file?")


def mask_tokens(tokens: np.ndarray, target: int, mask_prob: float, tables: WordPieceTables,
                rng: np.random.RandomState, *, max_ngram: int = MASKING_MAX_NGRAM,
                geometric: bool = False, replace: str = "bert") -> Masked:
    """Megatron's masking of ``tokens`` (see the module docstring). ``replace``: ``"bert"``
    (80% [MASK], 10% random, 10% kept, with draws) or ``"mask"`` (always [MASK], no draw)."""
    if replace not in ("bert", "mask"):
        raise ValueError(f"replace must be 'bert' or 'mask', got {replace!r}")
    length = tokens.shape[0]
    _check_known(tokens, tables)
    special = (tokens == tables.cls) | (tokens == tables.sep)
    nonspecial = ~special
    subword = tables.is_subword[tokens] & nonspecial
    # A "##" piece joins the word before it, unless no word has started yet.
    seen_before = (np.cumsum(nonspecial) - nonspecial) > 0
    starts = (nonspecial & ~subword) | (subword & ~seen_before)
    positions = np.flatnonzero(nonspecial)  # candidate tokens in order
    word_lo = np.flatnonzero(starts[positions])  # candidate c: positions[word_lo[c]:word_lo[c+1]]
    num_words = word_lo.shape[0]
    word_lo = np.append(word_lo, positions.shape[0]).tolist()
    positions = positions.tolist()

    n_maskings = min(mask_prob * target, max(1, int(round(length * mask_prob))))
    cdf = None if geometric else _ngram_cdf(max_ngram)
    bert_replace = replace == "bert"
    order = np.arange(num_words)
    rng.shuffle(order)
    out = tokens.copy()
    masked = np.zeros(length, dtype=bool)
    masked_pos: list[int] = []
    spans: list[list[int]] = []
    count = 0
    for c in order.tolist():
        if count >= n_maskings:
            break
        if geometric:
            n = min(int(rng.geometric(GEOMETRIC_P)), max_ngram)
        else:
            n = bisect_right(cdf, rng.random_sample()) + 1
        lo = word_lo[c]
        while True:
            hi = word_lo[min(c + n, num_words)]
            n -= 1
            if n_maskings >= count + (hi - lo):
                break
            if n == 0:
                hi = -1
                break
        if hi < 0:
            continue
        span = positions[lo:hi]
        if masked[span].any():
            continue
        for index in span:
            masked[index] = True
            if not bert_replace or rng.random_sample() < 0.8:
                out[index] = tables.mask
            elif rng.random_sample() >= 0.5:
                out[index] = tables.token_lookup[rng.randint(0, len(tables.token_lookup))]
            masked_pos.append(index)
        spans.append(span)
        count += len(span)
    where = np.sort(np.asarray(masked_pos, dtype=np.int64))
    spans.sort(key=lambda sp: sp[0])
    return Masked(out, where, tokens[where], spans)


def bert_sample(sentences: Sequence[np.ndarray], target_length: int, seq_length: int,
                rng: np.random.RandomState, tables: WordPieceTables, mask_prob: float,
                binary_head: bool) -> dict:
    """The sample dict (``text``, ``types``, ``labels``, ``is_random``, ``padding_mask``,
    ``loss_mask``, ``truncated``) of the sentences of one sample-index row."""
    n = len(sentences)
    pivot, is_random = n, False
    if binary_head:
        if n < 2:
            raise ValueError("a sample with the binary head needs at least two sentences")
        pivot = 1
        if n >= 3:
            pivot = rng.randint(low=1, high=n)
        is_random = rng.random_sample() < 0.5
    empty = np.zeros(0, dtype=np.int64)
    a = np.concatenate(sentences[:pivot]).astype(np.int64) if pivot else empty
    b = np.concatenate(sentences[pivot:]).astype(np.int64) if pivot < n else empty
    if is_random:
        a, b = b, a
    a, b, truncated = _truncate(a, b, target_length, rng)
    cls, sep = np.array([tables.cls], np.int64), np.array([tables.sep], np.int64)
    parts, types = [cls, a, sep], [np.zeros(a.shape[0] + 2, dtype=np.int64)]
    if b.shape[0]:
        parts += [b, sep]
        types.append(np.ones(b.shape[0] + 1, dtype=np.int64))
    tokens = np.concatenate(parts)
    tokens, masked_positions, masked_labels, _ = mask_tokens(tokens, target_length, mask_prob, tables, rng)

    pad = tables.pad
    length = tokens.shape[0]
    if length > seq_length:  # pragma: no cover - the index never targets more than seq_length - 3
        raise AssertionError(f"sample of {length} tokens for --seq-length {seq_length}")
    text = np.full(seq_length, pad, dtype=np.int64)
    text[:length] = tokens
    assignments = np.full(seq_length, pad, dtype=np.int64)
    assignments[:length] = np.concatenate(types)
    padding_mask = np.ones(seq_length, dtype=np.int64)
    padding_mask[text == pad] = pad
    labels = np.full(seq_length, -1, dtype=np.int64)
    labels[masked_positions] = masked_labels
    loss_mask = np.zeros(seq_length, dtype=np.int64)
    loss_mask[masked_positions] = 1
    text[text == pad] = 0
    labels[labels == pad] = 0
    return {"text": text, "types": assignments, "labels": labels, "is_random": int(is_random),
            "padding_mask": padding_mask, "loss_mask": loss_mask, "truncated": int(truncated)}
