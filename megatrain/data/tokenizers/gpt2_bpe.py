"""GPT-2 byte-level BPE (``--tokenizer-type GPT2BPETokenizer``) from vocab.json + merges.txt.

Owns the file reader (:func:`load_gpt2_files`), GPT-2's byte-to-unicode map and pre-tokenisation
pattern, and the choice of engine: ``tiktoken`` when the vocabulary's ids are the merge ranks
tiktoken would use (checked at load; true for the real GPT-2 files and for files written by
``megatrain train-tokenizer``), else Hugging Face ``tokenizers``. Both give GPT-2's ids. On the
tiktoken path pre-tokenized pieces longer than a few thousand characters are encoded in windows
(see ``megatrain.data.long_pieces``): the same ids in bounded time and memory.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Sequence

import numpy as np

from megatrain.data.long_pieces import LongPieceEncoder
from megatrain.data.tokenizers.base import MegatrainTokenizer, TokenizerConfig, need_file
from megatrain.json_input import parse_json

__all__ = [
    "GPT2_EOD", "GPT2_PATTERN", "GPT2BPETokenizer", "build_gpt2_bpe", "bytes_to_unicode", "load_gpt2_files",
]

# GPT-2's pre-tokenisation regex (the contraction alternatives written compactly).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOD = "<|endoftext|>"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


def load_gpt2_files(vocab_file: str, merge_file: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    try:
        with open(vocab_file, "rb") as f:
            vocab = parse_json(f.read())
    except (OSError, ValueError) as e:
        raise ValueError(f"--vocab-file {vocab_file}: cannot read a GPT-2 vocab.json ({e})") from None
    if not isinstance(vocab, dict) or not vocab or not all(
        isinstance(k, str) and isinstance(v, int) for k, v in vocab.items()
    ):
        raise ValueError(
            f"--vocab-file {vocab_file}: expected a JSON object mapping token strings to integer ids"
        )
    merges: list[tuple[str, str]] = []
    try:
        with open(merge_file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if not line or (lineno == 1 and line.startswith("#version")):
                    continue
                parts = line.split(" ")
                if len(parts) != 2:
                    raise ValueError(
                        f"--merge-file {merge_file} line {lineno}: expected two space-separated "
                        f"tokens, got {line[:80]!r}"
                    )
                a, b = parts
                if a not in vocab or b not in vocab or a + b not in vocab:
                    raise ValueError(
                        f"--merge-file {merge_file} line {lineno}: merge {a!r} {b!r} uses tokens "
                        f"missing from --vocab-file {vocab_file}"
                    )
                merges.append((a, b))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--merge-file {merge_file}: cannot read merges ({e})") from None
    if not merges:
        raise ValueError(f"--merge-file {merge_file}: no merges found")
    return vocab, merges


def _tiktoken_ranks(
    vocab: dict[str, int], merges: list[tuple[str, str]]
) -> tuple[dict[bytes, int], dict[str, int]] | None:
    """Mergeable ranks and special tokens for tiktoken, or None when tiktoken would differ.

    tiktoken merges the adjacent pair whose joined bytes have the lowest rank, with the id
    equal to that rank. That reproduces the BPE exactly when every single byte is a token,
    every other token is made by exactly one merge, and ids grow with merge order.
    """
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    byte_ids: dict[bytes, int] = {}
    for b, c in bytes_to_unicode().items():
        if c not in vocab:
            return None
        byte_ids[bytes([b])] = vocab[c]
    ranks = dict(byte_ids)
    last = max(byte_ids.values())
    produced: set[str] = set()
    for a, b in merges:
        tok = a + b
        if tok in produced:
            return None
        produced.add(tok)
        tid = vocab[tok]
        if tid <= last:
            return None
        last = tid
        try:
            ranks[bytes(decoder[c] for c in tok)] = tid
        except KeyError:
            return None
    single = set(bytes_to_unicode().values())
    special = {t: i for t, i in vocab.items() if t not in produced and t not in single}
    if len(set(ranks.values())) != len(ranks) or set(special.values()) & set(ranks.values()):
        return None
    return ranks, special


class GPT2BPETokenizer(MegatrainTokenizer):
    """GPT-2 byte-level BPE from vocab.json + merges.txt; eod is ``<|endoftext|>``.

    Text that contains ``<|endoftext|>`` is encoded as ordinary characters, as Megatron does.
    """

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str, backend: str = "auto"):
        if backend not in ("auto", "tiktoken", "hf"):
            raise ValueError(f"unknown GPT-2 BPE backend {backend!r} (auto, tiktoken or hf)")
        self.vocab_file, self.merge_file = vocab_file, merge_file
        vocab, merges = load_gpt2_files(vocab_file, merge_file)
        if GPT2_EOD not in vocab:
            raise ValueError(f"--vocab-file {vocab_file}: has no {GPT2_EOD} token (the end-of-document id)")
        self._vocab = vocab
        self._inv_vocab: dict[int, str] | None = None
        self._eod = vocab[GPT2_EOD]
        self._vocab_size = len(vocab)
        self._tiktoken = None
        self._hf = None
        ranks = _tiktoken_ranks(vocab, merges) if backend != "hf" else None
        if backend == "tiktoken" and ranks is None:
            raise ValueError(
                f"--vocab-file {vocab_file} / --merge-file {merge_file}: ids are not merge ranks, "
                "tiktoken cannot reproduce this BPE (use the 'hf' backend)"
            )
        if ranks is not None:
            import tiktoken

            mergeable, special = ranks
            self._tiktoken = tiktoken.Encoding(
                name=f"gpt2bpe:{os.path.abspath(vocab_file)}",
                pat_str=GPT2_PATTERN,
                mergeable_ranks=mergeable,
                special_tokens=special,
            )
            self._long = LongPieceEncoder(self._tiktoken, GPT2_PATTERN, mergeable)
        else:
            self._hf = _hf_byte_level_bpe(vocab, merges)

    @property
    def backend(self) -> str:
        return "tiktoken" if self._tiktoken is not None else "hf"

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._eod

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        if self._inv_vocab is None:
            self._inv_vocab = {i: t for t, i in self._vocab.items()}
        return self._inv_vocab

    def tokenize(self, text: str) -> list[int]:
        if self._tiktoken is not None:
            return self._long.encode(text)
        return self._hf.encode(text, add_special_tokens=False).ids

    def tokenize_to_numpy(self, text: str, dtype=np.int32) -> np.ndarray:
        if self._tiktoken is not None:
            return self._long.encode_to_numpy(text).astype(dtype, copy=False)
        return np.asarray(self._hf.encode(text, add_special_tokens=False).ids, dtype=dtype)

    def batch_tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        if self._tiktoken is not None:
            texts = list(texts)
            if any(self._long.has_long_piece(t) for t in texts):
                return [self._long.encode(t) for t in texts]
            return self._tiktoken.encode_ordinary_batch(texts)
        return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._tiktoken is not None:
            return self._tiktoken.decode(ids, errors="replace")
        return self._hf.decode(ids, skip_special_tokens=False)


def _hf_byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def build_gpt2_bpe(cfg: TokenizerConfig) -> GPT2BPETokenizer:
    return GPT2BPETokenizer(
        need_file(cfg.vocab_file, "--vocab-file", "GPT2BPETokenizer"),
        need_file(cfg.merge_file, "--merge-file", "GPT2BPETokenizer"),
        backend=cfg.bpe_backend,
    )
