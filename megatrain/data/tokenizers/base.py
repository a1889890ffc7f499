"""The shared tokenizer interface: :class:`MegatrainTokenizer`, the :class:`TokenizerConfig` every
builder reads, and the file checks the builders use to name a missing flag or path."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, Sequence

import numpy as np

__all__ = ["MegatrainTokenizer", "TokenizerConfig", "need_file", "need_path"]


@dataclass
class TokenizerConfig:
    """What :func:`build_tokenizer` needs; field names are Megatron's argparse dests."""

    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    vocab_extra_ids: int = 0
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int = 1000
    tiktoken_special_tokens: list[str] | None = None
    #: GPT2BPETokenizer only: "auto" (tiktoken when exact, else HF), "tiktoken" or "hf".
    bpe_backend: str = "auto"
    #: SFTTokenizer only: how conversations render (None: Megatron's default, nemotron-h-aligned).
    sft_tokenizer_prompt_format: str | None = None

    @classmethod
    def from_namespace(cls, ns: Any) -> "TokenizerConfig":
        """Pick the tokenizer fields out of any object (argparse namespace, dict, config)."""
        if isinstance(ns, cls):
            return ns
        get = ns.get if isinstance(ns, dict) else lambda k, d: getattr(ns, k, d)
        values = {}
        for f in fields(cls):
            values[f.name] = get(f.name, f.default)
        if values["bpe_backend"] is None:
            values["bpe_backend"] = "auto"
        if values["tiktoken_num_special_tokens"] is None:
            values["tiktoken_num_special_tokens"] = 1000
        if values["vocab_extra_ids"] is None:
            values["vocab_extra_ids"] = 0
        return cls(**values)


def need_path(path: str | None, flag: str, kind: str) -> str:
    """``path`` when it exists; else ValueError naming ``flag`` (and ``kind`` when it is unset)."""
    if not path:
        raise ValueError(f"{kind} needs {flag}")
    if not os.path.exists(path):
        raise ValueError(f"{flag} {path}: no such file or directory")
    return os.fspath(path)


def need_file(path: str | None, flag: str, kind: str) -> str:
    """As :func:`need_path`, and the path must be a file."""
    path = need_path(path, flag, kind)
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: not a file")
    return path


class MegatrainTokenizer(ABC):
    """Text <-> token ids, plus the special ids the data pipeline needs."""

    #: Short name of the type (Megatron's ``--tokenizer-type`` value).
    name: str = ""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (before any padding for the model)."""

    @property
    @abstractmethod
    def eod(self) -> int | None:
        """End-of-document id appended by ``--append-eod``."""

    @property
    def pad(self) -> int | None:
        return None

    @property
    def bos(self) -> int | None:
        return None

    @property
    def eos(self) -> int | None:
        return self.eod

    @property
    def end_ids(self) -> list[int]:
        """Ids that end a generation (eod; a Hugging Face folder's may list more)."""
        return [self.eod] if self.eod is not None else []

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""

    def batch_tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def tokenize_to_numpy(self, text: str, dtype=np.int32) -> np.ndarray:
        """Token ids as a numpy array (the preprocessing hot path)."""
        return np.asarray(self.tokenize(text), dtype=dtype)

    @property
    def vocab(self) -> dict[str, int]:
        raise NotImplementedError(f"{type(self).__name__} has no vocabulary mapping")

    @property
    def inv_vocab(self) -> dict[int, str]:
        raise NotImplementedError(f"{type(self).__name__} has no vocabulary mapping")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"

