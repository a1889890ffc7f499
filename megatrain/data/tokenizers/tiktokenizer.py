"""tiktoken ranks files as Megatron's ``TikTokenizer`` reads them (``--tokenizer-type
TikTokenizer``): the two ranks formats, the ``--tiktoken-pattern`` v1/v2 pre-tokenisation
patterns and the special-token layout. Long pre-tokenized pieces are encoded in windows (see
``megatrain.data.long_pieces``): the same ids in bounded time and memory."""

from __future__ import annotations

import base64
import os
from typing import Sequence

import numpy as np

from megatrain.data.long_pieces import LongPieceEncoder
from megatrain.data.tokenizers.base import MegatrainTokenizer, TokenizerConfig, need_file
from megatrain.json_input import parse_json

__all__ = [
    "TIKTOKEN_DEFAULT_SPECIAL_TOKENS", "TIKTOKEN_PATTERN_V1", "TIKTOKEN_PATTERN_V2", "TikTokenizer",
    "build_tiktokenizer",
]

# Megatron's TikTokenizer patterns (--tiktoken-pattern v1 / v2).
TIKTOKEN_PATTERN_V1 = (
    r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
TIKTOKEN_PATTERN_V2 = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TIKTOKEN_DEFAULT_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def _load_tiktoken_ranks(path: str, max_vocab: int | None) -> dict[bytes, int]:
    """Ranks from Megatron's JSON list (``rank``/``token_bytes``/``token_str``) or from a
    ``.tiktoken`` file of ``base64-token rank`` lines. Ranks must be 0..n-1 and include
    all 256 single bytes."""
    ranks: dict[bytes, int] = {}
    try:
        if path.endswith(".json"):
            with open(path, "rb") as f:
                data = parse_json(f.read())
            if not isinstance(data, list):
                raise ValueError("expected a JSON list of {rank, token_bytes, token_str}")
            for i, item in enumerate(data):
                ranks[base64.b64decode(item["token_bytes"])] = int(item["rank"])
        else:
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    parts = line.split()
                    if len(parts) != 2:
                        raise ValueError(f"line {lineno}: expected 'base64-token rank'")
                    ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--tokenizer-model {path}: not a tiktoken ranks file ({e})") from None
    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    if [r for _, r in ordered] != list(range(len(ordered))):
        raise ValueError(f"--tokenizer-model {path}: ranks must be 0..{len(ordered) - 1} without gaps")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(f"--tokenizer-model {path}: every single byte 0..255 must have a rank")
    if max_vocab is not None:
        ordered = ordered[:max_vocab]
    return dict(ordered)


class TikTokenizer(MegatrainTokenizer):
    """Megatron's ``TikTokenizer``: ``num_special_tokens`` special ids first (``<unk>``,
    ``<s>``, ``</s>``, then any listed, then ``<SPECIAL_i>`` fillers), the BPE ranks shifted
    after them, the vocabulary cut to ``vocab_size`` (default 131072). eod is ``</s>``."""

    name = "TikTokenizer"

    def __init__(
        self,
        path: str,
        pattern: str = "v2",
        vocab_size: int | None = None,
        num_special_tokens: int = 1000,
        special_tokens: Sequence[str] | None = None,
    ):
        import tiktoken

        pat = {"v1": TIKTOKEN_PATTERN_V1, "v2": TIKTOKEN_PATTERN_V2}.get(pattern)
        if pat is None:
            raise ValueError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}")
        self._vocab_size = int(vocab_size) if vocab_size is not None else 2**17
        specials = list(special_tokens) if special_tokens is not None else list(TIKTOKEN_DEFAULT_SPECIAL_TOKENS)
        if len(set(specials)) != len(specials):
            raise ValueError(f"--tiktoken-special-tokens must be unique: {specials}")
        missing = [t for t in TIKTOKEN_DEFAULT_SPECIAL_TOKENS if t not in specials]
        if missing:
            raise ValueError(f"--tiktoken-special-tokens must include {missing}")
        if not len(specials) <= num_special_tokens < self._vocab_size:
            raise ValueError(
                f"--tiktoken-num-special-tokens {num_special_tokens} must be at least the "
                f"{len(specials)} special tokens and below --vocab-size {self._vocab_size}"
            )
        specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
        inner = _load_tiktoken_ranks(path, self._vocab_size - num_special_tokens)
        if len(inner) + num_special_tokens != self._vocab_size:
            raise ValueError(
                f"--tokenizer-model {path} has {len(inner)} ranks; with {num_special_tokens} "
                f"special tokens that is fewer than --vocab-size {self._vocab_size}"
            )
        shifted = {t: r + num_special_tokens for t, r in inner.items()}
        special_ids = {t: i for i, t in enumerate(specials)}
        self._model = tiktoken.Encoding(
            name=f"tiktoken:{os.path.abspath(path)}",
            pat_str=pat,
            mergeable_ranks=shifted,
            special_tokens=special_ids,
        )
        self._special_ids = special_ids
        self._ranks = shifted
        self._long = LongPieceEncoder(self._model, pat, shifted)
        self._unk, self._bos, self._eos = special_ids["<unk>"], special_ids["<s>"], special_ids["</s>"]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eos

    @property
    def bos(self) -> int:
        return self._bos

    @property
    def pad(self) -> int:
        return self._eos

    @property
    def unk(self) -> int:
        return self._unk

    @property
    def vocab(self) -> dict[bytes | str, int]:  # type: ignore[override]
        return {**self._ranks, **self._special_ids}

    @property
    def inv_vocab(self) -> dict[int, bytes | str]:  # type: ignore[override]
        return {i: t for t, i in self.vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return self._long.encode(text)

    def tokenize_to_numpy(self, text: str, dtype=np.int32) -> np.ndarray:
        return self._long.encode_to_numpy(text).astype(dtype, copy=False)

    def batch_tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        texts = list(texts)
        if any(self._long.has_long_piece(t) for t in texts):
            return [self._long.encode(t) for t in texts]
        return self._model.encode_ordinary_batch(texts)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._model.decode([int(i) for i in ids], errors="replace")



def build_tiktokenizer(cfg: TokenizerConfig) -> TikTokenizer:
    if cfg.tiktoken_pattern not in ("v1", "v2"):
        raise ValueError("TikTokenizer needs --tiktoken-pattern v1 or v2")
    return TikTokenizer(
        need_file(cfg.tokenizer_model, "--tokenizer-model", "TikTokenizer"),
        pattern=cfg.tiktoken_pattern,
        vocab_size=cfg.vocab_size,
        num_special_tokens=cfg.tiktoken_num_special_tokens,
        special_tokens=cfg.tiktoken_special_tokens,
    )
