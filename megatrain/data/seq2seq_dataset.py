"""Fine-tuning examples for an encoder-decoder (T5): ``{"input": ..., "target": ...}`` jsonl lines as
samples with the T5 pre-training dataset's field names (``megatrain.data.t5_dataset``), so the
family's own objective trains on them with teacher forcing.

One example becomes:

* ``text_enc`` [encoder_seq_length]: the input's tokens (no special tokens around them, as in T5's
  pre-training samples), cut to the encoder length; ``enc_mask`` 1 on them;
* ``text_dec`` [decoder_seq_length]: ``[bos]`` then the target's tokens; ``labels``: the target's
  tokens then ``[eos]`` (one position ahead), -1 after; ``loss_mask`` and ``dec_mask`` 1 on them. A
  target too long for the decoder is cut (and then has no ``[eos]``);
* pads written as 0, ``truncated`` 1 when either side was cut.

A literal ``<extra_id_i>`` in a text is the sentinel token the tokenizer has for it
(:func:`tokenize_with_sentinels`), as in Hugging Face's T5 tokenizers. Bad lines raise ValueError
naming the flag, the file and the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from megatrain.data.jsonl import iter_jsonl

__all__ = ["Seq2SeqExample", "read_seq2seq_examples", "tokenize_with_sentinels", "encode_seq2seq",
           "Seq2SeqDataset", "encode_seq2seq_examples"]

_SENTINEL = re.compile(r"<extra_id_\d+>")


@dataclass
class Seq2SeqExample:
    input: str
    target: str
    where: str  # FLAG FILE:LINE


def read_seq2seq_examples(paths: Sequence[str], flag: str, *, input_key: str = "input",
                          target_key: str = "target") -> list[Seq2SeqExample]:
    """Every example of the jsonl files ``paths``; a bad line raises ValueError naming the flag, file and line."""
    out: list[Seq2SeqExample] = []
    for path in paths:
        count = 0
        for lineno, obj in iter_jsonl(path, flag):
            where = f"{flag} {path}:{lineno}"
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object with string {input_key!r} and {target_key!r}")
            for key in (input_key, target_key):
                if not isinstance(obj.get(key), str):
                    raise ValueError(f"{where}: expected a string {key!r}"
                                     + ("" if key in obj else f" (keys: {', '.join(map(repr, list(obj)[:5]))})"))
            out.append(Seq2SeqExample(obj[input_key], obj[target_key], where))
            count += 1
        if count == 0:
            raise ValueError(f"{flag} {path}: no examples (the file is empty)")
    return out


def tokenize_with_sentinels(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.tokenize(text)``, except that each literal ``<extra_id_i>`` the tokenizer has as a
    sentinel (``--vocab-extra-ids``) becomes that token's id."""
    sentinels = dict(zip(getattr(tokenizer, "additional_special_tokens", None) or [],
                         getattr(tokenizer, "additional_special_tokens_ids", None) or []))
    if not sentinels or "<extra_id_" not in text:
        return list(tokenizer.tokenize(text))
    ids: list[int] = []
    start = 0
    for m in _SENTINEL.finditer(text):
        if m.group() not in sentinels:
            continue  # not one of the tokenizer's: plain text
        if text[start:m.start()].strip():
            ids += tokenizer.tokenize(text[start:m.start()])
        ids.append(sentinels[m.group()])
        start = m.end()
    if text[start:].strip():
        ids += tokenizer.tokenize(text[start:])
    return ids


def encode_seq2seq(input_ids: Sequence[int], target_ids: Sequence[int], encoder_seq_length: int,
                   decoder_seq_length: int, bos: int, eos: int) -> dict[str, np.ndarray | int]:
    """One sample (the fields of the module docstring) of tokenized input and target."""
    enc = list(input_ids)[:encoder_seq_length]
    dec_in = [bos, *target_ids][:decoder_seq_length]
    labels = [*target_ids, eos][:decoder_seq_length]
    truncated = len(input_ids) > encoder_seq_length or len(target_ids) + 1 > decoder_seq_length
    text_enc = np.zeros(encoder_seq_length, dtype=np.int64)
    text_enc[:len(enc)] = enc
    enc_mask = np.zeros(encoder_seq_length, dtype=np.int64)
    enc_mask[:len(enc)] = 1
    text_dec = np.zeros(decoder_seq_length, dtype=np.int64)
    text_dec[:len(dec_in)] = dec_in
    out = np.full(decoder_seq_length, -1, dtype=np.int64)
    out[:len(labels)] = labels
    dec_mask = np.zeros(decoder_seq_length, dtype=np.int64)
    dec_mask[:len(dec_in)] = 1
    return {"text_enc": text_enc, "text_dec": text_dec, "labels": out, "loss_mask": dec_mask.copy(),
            "truncated": int(truncated), "enc_mask": enc_mask, "dec_mask": dec_mask}


def encode_seq2seq_examples(examples: Sequence[Seq2SeqExample], tokenizer: Any, encoder_seq_length: int,
                            decoder_seq_length: int) -> tuple[list[dict[str, Any]], int]:
    """The samples of ``examples`` and how many were truncated. The tokenizer needs bos and eos (the
    decoder's first input and last label); an input without tokens is refused (nothing to attend to)."""
    bos, eos = getattr(tokenizer, "bos", None), getattr(tokenizer, "eos", None)
    if eos is None:
        eos = getattr(tokenizer, "eod", None)
    if bos is None or eos is None:
        name = getattr(tokenizer, "name", "") or type(tokenizer).__name__
        raise ValueError(f"--tokenizer-type {name} has no bos/eos token: the T5 decoder starts with bos and "
                         "ends with eos (BertWordPieceLowerCase: [CLS] and [SEP])")
    samples, truncated = [], 0
    for e in examples:
        input_ids = tokenize_with_sentinels(tokenizer, e.input)
        if not input_ids:
            raise ValueError(f"{e.where}: the input has no tokens")
        sample = encode_seq2seq(input_ids, tokenize_with_sentinels(tokenizer, e.target), encoder_seq_length,
                                decoder_seq_length, int(bos), int(eos))
        truncated += int(sample["truncated"])
        samples.append(sample)
    return samples, truncated


class Seq2SeqDataset(torch.utils.data.Dataset):
    """``num_samples`` samples over epochs of the encoded examples: with ``seed`` reshuffled every
    epoch (training), without it in file order (validation)."""

    def __init__(self, samples: list[dict[str, Any]], num_samples: int | None = None, seed: int | None = None) -> None:
        if not samples:
            raise ValueError("no examples")
        self.samples, self.seed = samples, seed
        self.num_samples = int(num_samples) if num_samples is not None else len(samples)
        self._orders: dict[int, np.ndarray] = {}

    @property
    def num_examples(self) -> int:
        return len(self.samples)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        epoch, pos = divmod(int(index), self.num_examples)
        if self.seed is not None:
            if epoch not in self._orders:
                self._orders[epoch] = np.random.RandomState(self.seed + epoch).permutation(self.num_examples)
            pos = int(self._orders[epoch][pos])
        return self.samples[pos]
