"""Tokenizers selected by Megatron-LM's ``--tokenizer-type``, behind one interface.

Every type implements :class:`MegatrainTokenizer` and is built by :func:`build_tokenizer`
from a :class:`TokenizerConfig` or an argparse namespace carrying Megatron's flag names
(see :func:`add_tokenizer_args`). All of them read local files only; none downloads.

Types and what they need:

================================  ===========================================================
``GPT2BPETokenizer``              ``--vocab-file`` vocab.json, ``--merge-file`` merges.txt
``HuggingFaceTokenizer``          ``--tokenizer-model`` tokenizer.json or a folder holding it
``SentencePieceTokenizer``        ``--tokenizer-model`` .model (Megatron's extra special tokens)
``GPTSentencePieceTokenizer``     ``--tokenizer-model`` .model (plain ids, eod = eos)
``Llama2Tokenizer``               ``--tokenizer-model`` .model (bos prepended, eod = eos)
``TikTokenizer``                  ``--tokenizer-model`` ranks file, ``--tiktoken-pattern v1|v2``
``BertWordPieceLowerCase/Case``   ``--vocab-file`` vocab.txt
``NullTokenizer``                 ``--vocab-size N``: text is space-separated ids, eod = N
================================  ===========================================================

The GPT-2 BPE runs on ``tiktoken`` when the vocabulary's ids are the merge ranks tiktoken
would use (checked at load; true for the real GPT-2 files and for files written by
``megatrain train-tokenizer``), else on Hugging Face ``tokenizers``. Both give GPT-2's ids.
On the tiktoken paths (GPT-2 BPE and ``TikTokenizer``) pre-tokenized pieces longer than a few
thousand characters (a long line without spaces) are encoded in windows joined at a token both
windows agree on: the same ids in bounded time and memory (see ``megatrain.data.long_pieces``).
"""

from __future__ import annotations

import argparse
import base64
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from megatrain.data.long_pieces import LongPieceEncoder
from megatrain.flags import flag_section
from megatrain.json_input import parse_json

__all__ = [
    "TOKENIZER_TYPES",
    "MegatrainTokenizer",
    "TokenizerConfig",
    "add_tokenizer_args",
    "build_tokenizer",
    "bytes_to_unicode",
]

TOKENIZER_TYPES = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
)

# GPT-2's pre-tokenisation regex (the contraction alternatives written compactly).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
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
GPT2_EOD = "<|endoftext|>"


# ----------------------------------------------------------------------------------------
# configuration and command line
# ----------------------------------------------------------------------------------------
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


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's tokenizer flags (same names, dests and defaults)."""
    group = flag_section(parser, "tokenizer")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="Size of vocab before EOD or padding (NullTokenizer, TikTokenizer).")
    group.add_argument("--vocab-file", type=str, default=None, help="Path to the vocab file.")
    group.add_argument("--merge-file", type=str, default=None, help="Path to the BPE merge file.")
    group.add_argument("--vocab-extra-ids", type=int, default=0,
                       help="Number of additional vocabulary tokens (T5 sentinels).")
    group.add_argument("--tokenizer-type", type=str, default=None, choices=list(TOKENIZER_TYPES),
                       help="What type of tokenizer to use.")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="Tokenizer model file (SentencePiece .model, tiktoken ranks, "
                            "tokenizer.json or a folder holding one).")
    group.add_argument("--tiktoken-pattern", type=str, default=None, choices=["v1", "v2"],
                       help="Which tiktoken pre-tokenisation pattern to use (TikTokenizer).")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="Number of special tokens in the tiktoken tokenizer.")
    group.add_argument("--tiktoken-special-tokens", type=str, nargs="+", default=None,
                       help="List of tiktoken special tokens, needs to include <unk>, <s> and </s>.")
    return parser


def build_tokenizer(cfg: Any) -> "MegatrainTokenizer":
    """Build the tokenizer named by ``cfg.tokenizer_type`` (a config, namespace or dict)."""
    cfg = TokenizerConfig.from_namespace(cfg)
    kind = cfg.tokenizer_type
    if kind is None:
        raise ValueError(f"--tokenizer-type is required; choose one of: {', '.join(TOKENIZER_TYPES)}")
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(
            _need_file(cfg.vocab_file, "--vocab-file", kind),
            _need_file(cfg.merge_file, "--merge-file", kind),
            backend=cfg.bpe_backend,
        )
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return BertWordPieceTokenizer(
            _need_file(cfg.vocab_file, "--vocab-file", kind),
            lower_case=kind == "BertWordPieceLowerCase",
            vocab_extra_ids=cfg.vocab_extra_ids,
        )
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_need_path(cfg.tokenizer_model, "--tokenizer-model", kind))
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(
            _need_file(cfg.tokenizer_model, "--tokenizer-model", kind), vocab_extra_ids=cfg.vocab_extra_ids
        )
    if kind == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(_need_file(cfg.tokenizer_model, "--tokenizer-model", kind))
    if kind == "Llama2Tokenizer":
        return Llama2Tokenizer(_need_file(cfg.tokenizer_model, "--tokenizer-model", kind))
    if kind == "TikTokenizer":
        if cfg.tiktoken_pattern not in ("v1", "v2"):
            raise ValueError("TikTokenizer needs --tiktoken-pattern v1 or v2")
        return TikTokenizer(
            _need_file(cfg.tokenizer_model, "--tokenizer-model", kind),
            pattern=cfg.tiktoken_pattern,
            vocab_size=cfg.vocab_size,
            num_special_tokens=cfg.tiktoken_num_special_tokens,
            special_tokens=cfg.tiktoken_special_tokens,
        )
    if kind == "NullTokenizer":
        if cfg.vocab_size is None or cfg.vocab_size <= 0:
            raise ValueError("NullTokenizer needs --vocab-size N (a positive integer)")
        return NullTokenizer(cfg.vocab_size)
    raise ValueError(f"--tokenizer-type {kind!r} is not supported; choose one of: {', '.join(TOKENIZER_TYPES)}")


def _need_path(path: str | None, flag: str, kind: str) -> str:
    if not path:
        raise ValueError(f"{kind} needs {flag}")
    if not os.path.exists(path):
        raise ValueError(f"{flag} {path}: no such file or directory")
    return os.fspath(path)


def _need_file(path: str | None, flag: str, kind: str) -> str:
    path = _need_path(path, flag, kind)
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: not a file")
    return path


# ----------------------------------------------------------------------------------------
# the interface
# ----------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------
# GPT-2 byte-level BPE
# ----------------------------------------------------------------------------------------
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


def _load_gpt2_files(vocab_file: str, merge_file: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
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
        vocab, merges = _load_gpt2_files(vocab_file, merge_file)
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


# ----------------------------------------------------------------------------------------
# Hugging Face tokenizer.json
# ----------------------------------------------------------------------------------------
_EOS_GUESSES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
_BOS_GUESSES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]")
_PAD_GUESSES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


class HuggingFaceTokenizer(MegatrainTokenizer):
    """A Hugging Face ``tokenizer.json`` (fast ``tokenizers`` library, no ``transformers``).

    Special tokens are read from ``tokenizer_config.json`` / ``special_tokens_map.json``
    beside the file when present, else recognised by their usual names. ``tokenize``
    applies the file's post-processor (e.g. a BOS token), as ``AutoTokenizer`` does.
    """

    name = "HuggingFaceTokenizer"

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        if os.path.isdir(path):
            folder, file = path, os.path.join(path, "tokenizer.json")
            if not os.path.isfile(file):
                raise ValueError(f"--tokenizer-model {path}: folder has no tokenizer.json")
        else:
            folder, file = os.path.dirname(path), path
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # the library raises plain Exception subclasses
            raise ValueError(f"--tokenizer-model {file}: not a valid tokenizer.json ({e})") from None
        self.path = file
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        self._inv_vocab: dict[int, str] | None = None
        named = self._read_special_names(folder)
        self._eod = self._special_id(named.get("eos_token"), _EOS_GUESSES)
        self._bos = self._special_id(named.get("bos_token"), _BOS_GUESSES)
        self._pad = self._special_id(named.get("pad_token"), _PAD_GUESSES)

    @staticmethod
    def _read_special_names(folder: str) -> dict[str, str]:
        names: dict[str, str] = {}
        for fname in ("special_tokens_map.json", "tokenizer_config.json"):
            p = os.path.join(folder, fname) if folder else fname
            if not os.path.isfile(p):
                continue
            try:
                with open(p, "rb") as f:
                    data = parse_json(f.read())
            except (OSError, ValueError) as e:
                raise ValueError(f"--tokenizer-model: cannot read {p} ({e})") from None
            if not isinstance(data, dict):
                raise ValueError(f"--tokenizer-model: {p} must hold a JSON object, not {type(data).__name__}")
            for key in ("eos_token", "bos_token", "pad_token"):
                v = data.get(key)
                if isinstance(v, dict):
                    v = v.get("content")
                if isinstance(v, str) and key not in names:
                    names[key] = v
        return names

    def _special_id(self, name: str | None, guesses: Sequence[str]) -> int | None:
        if name is not None and name in self._vocab:
            return self._vocab[name]
        for g in guesses:
            if g in self._vocab:
                return self._vocab[g]
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int | None:
        return self._eod

    @property
    def bos(self) -> int | None:
        return self._bos

    @property
    def pad(self) -> int | None:
        return self._pad

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        if self._inv_vocab is None:
            self._inv_vocab = {i: t for t, i in self._vocab.items()}
        return self._inv_vocab

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def batch_tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


# ----------------------------------------------------------------------------------------
# SentencePiece
# ----------------------------------------------------------------------------------------
def _load_sentencepiece(model_file: str):
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except Exception as e:  # sentencepiece raises OSError / RuntimeError
        raise ValueError(f"--tokenizer-model {model_file}: not a SentencePiece model ({e})") from None


class SentencePieceTokenizer(MegatrainTokenizer):
    """Megatron's ``SentencePieceTokenizer``: the model plus special tokens
    ``<CLS> <SEP> <EOD> <MASK>``, pad/bos/eos and ``<extra_id_i>`` appended after the model's
    vocabulary when missing. Special-token text in the input maps to its id; eod is ``<EOD>``."""

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        self._sp = _load_sentencepiece(model_file)
        self._vocab = {self._sp.id_to_piece(i): i for i in range(len(self._sp))}
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self._special: dict[str, int] = {}

        def add(token: str) -> int:
            if token not in self._vocab:
                nid = len(self._vocab)
                self._vocab[token] = nid
                self._inv_vocab[nid] = token
            self._special[token] = self._vocab[token]
            return self._vocab[token]

        self.cls, self.sep = add("<CLS>"), add("<SEP>")
        self._eod = add("<EOD>")
        self.mask = add("<MASK>")

        def piece_or(idx: int, fallback: str) -> str:
            return self._sp.id_to_piece(idx) if 0 <= idx < len(self._sp) else fallback

        self._pad = add(piece_or(self._sp.pad_id(), "<PAD>"))
        self._bos = add(piece_or(self._sp.bos_id(), "<BOS>"))
        self._eos = add(piece_or(self._sp.eos_id(), "<EOS>"))
        self.additional_special_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for t in self.additional_special_tokens:
            add(t)
        self._inv_special = {i: t for t, i in self._special.items()}
        import regex

        ordered = sorted(self._special, key=len, reverse=True)
        self._special_re = regex.compile("|".join(regex.escape(t) for t in ordered))

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eos

    @property
    def bos(self) -> int:
        return self._bos

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            ids.extend(self._sp.encode_as_ids(text[pos : m.start()]))
            ids.append(self._special[m.group(0)])
            pos = m.end()
        ids.extend(self._sp.encode_as_ids(text[pos:]))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        text, last = "", 0
        for i, tid in enumerate(ids):
            if tid in self._inv_special:
                text += self._sp.decode_ids(ids[last:i]) + " " + self._inv_special[tid] + " "
                last = i + 1
        return text + self._sp.decode_ids(ids[last:])


class GPTSentencePieceTokenizer(MegatrainTokenizer):
    """Plain SentencePiece ids (Megatron's ``GPTSentencePieceTokenizer``); eod is the model's eos."""

    name = "GPTSentencePieceTokenizer"
    _prepend_bos = False

    def __init__(self, model_file: str):
        self._sp = _load_sentencepiece(model_file)

    @property
    def vocab_size(self) -> int:
        return len(self._sp)

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int | None:
        b = self._sp.bos_id()
        return b if b >= 0 else None

    @property
    def pad(self) -> int | None:
        p = self._sp.pad_id()
        return p if p >= 0 else None

    @property
    def vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(len(self._sp))}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: self._sp.id_to_piece(i) for i in range(len(self._sp))}

    def tokenize(self, text: str) -> list[int]:
        ids = self._sp.encode_as_ids(text)
        return [self._sp.bos_id(), *ids] if self._prepend_bos else ids

    def batch_tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        out = self._sp.encode_as_ids(list(texts))
        return [[self._sp.bos_id(), *x] for x in out] if self._prepend_bos else out

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode_ids([int(i) for i in ids])


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's ``Llama2Tokenizer``: SentencePiece ids with the bos id prepended."""

    name = "Llama2Tokenizer"
    _prepend_bos = True


# ----------------------------------------------------------------------------------------
# tiktoken ranks files (Megatron's TikTokenizer)
# ----------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------
# BERT WordPiece
# ----------------------------------------------------------------------------------------
class BertWordPieceTokenizer(MegatrainTokenizer):
    """BERT WordPiece from a vocab.txt (HF ``tokenizers``), Megatron's conventions: ids
    without [CLS]/[SEP]; ``[BOS]``, ``[EOS]`` and ``<extra_id_i>`` appended when missing;
    eod is ``[EOS]``."""

    def __init__(self, vocab_file: str, lower_case: bool = True, vocab_extra_ids: int = 0):
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

        self.name = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        vocab: dict[str, int] = {}
        try:
            with open(vocab_file, encoding="utf-8") as f:
                for line in f:
                    tok = line.rstrip("\r\n")
                    if tok and tok not in vocab:
                        vocab[tok] = len(vocab)
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--vocab-file {vocab_file}: cannot read a WordPiece vocab.txt ({e})") from None
        for needed in ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"):
            if needed not in vocab:
                raise ValueError(f"--vocab-file {vocab_file}: WordPiece vocab has no {needed} token")
        base = dict(vocab)
        for t in ["[BOS]", "[EOS]"] + [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]:
            if t not in vocab:
                vocab[t] = len(vocab)
        self._vocab = vocab
        self._inv_vocab = {i: t for t, i in vocab.items()}
        tok = Tokenizer(models.WordPiece(vocab=base, unk_token="[UNK]", max_input_chars_per_word=100))
        tok.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=lower_case, lowercase=lower_case
        )
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        self._tok = tok
        self.cls, self.sep, self.mask = vocab["[CLS]"], vocab["[SEP]"], vocab["[MASK]"]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eod(self) -> int:
        return self._vocab["[EOS]"]

    @property
    def eos(self) -> int:
        return self._vocab["[EOS]"]

    @property
    def bos(self) -> int:
        return self._vocab["[BOS]"]

    @property
    def pad(self) -> int:
        return self._vocab["[PAD]"]

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def batch_tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        tokens = [self._inv_vocab[int(i)] for i in ids]
        return " ".join(tokens).replace(" ##", "").strip()


# ----------------------------------------------------------------------------------------
# Null tokenizer
# ----------------------------------------------------------------------------------------
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
