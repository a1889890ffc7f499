"""Hugging Face ``tokenizer.json`` files (``--tokenizer-type HuggingFaceTokenizer``), read with the
fast ``tokenizers`` library (no ``transformers``): the file or folder, and how its eos/bos/pad
ids are found."""

from __future__ import annotations

import os
from typing import Sequence

from megatrain.data.tokenizers.base import MegatrainTokenizer, TokenizerConfig, need_path
from megatrain.json_input import parse_json

__all__ = ["HuggingFaceTokenizer", "build_huggingface"]

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


def build_huggingface(cfg: TokenizerConfig) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(need_path(cfg.tokenizer_model, "--tokenizer-model", "HuggingFaceTokenizer"))
