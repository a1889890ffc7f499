"""``--tokenizer-type NullTokenizer``: text that is already token ids, as Megatron-LM reads it
(``--vocab-size N``; used with mock data and by most tests)."""

from __future__ import annotations

from typing import Sequence

from megatrain.data.tokenizers.base import MegatrainTokenizer, TokenizerConfig

__all__ = ["NullTokenizer", "build_null"]


class NullTokenizer(MegatrainTokenizer):
    """Text is already ids separated by spaces. As in Megatron, ``--vocab-size N`` gives
    ids 0..N-1 for text, eod = N and ``vocab_size`` = N + 1."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        self._n = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def eod(self) -> int:
        return self._n

    @property
    def pad(self) -> int:
        return self._n

    def tokenize(self, text: str) -> list[int]:
        out = []
        for piece in text.split():
            try:
                tid = int(piece)
            except ValueError:
                raise ValueError(
                    f"NullTokenizer expects space-separated integer ids, got {piece[:40]!r}"
                ) from None
            if not 0 <= tid <= self._n:
                raise ValueError(f"NullTokenizer id {tid} is outside 0..{self._n} (--vocab-size {self._n})")
            out.append(tid)
        return out

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_null(cfg: TokenizerConfig) -> NullTokenizer:
    if cfg.vocab_size is None or cfg.vocab_size <= 0:
        raise ValueError("NullTokenizer needs --vocab-size N (a positive integer)")
    return NullTokenizer(cfg.vocab_size)
