"""SentencePiece ``.model`` files, as Megatron's three types read them: ``SentencePieceTokenizer``
(extra special tokens appended), ``GPTSentencePieceTokenizer`` (plain ids, eod = eos) and
``Llama2Tokenizer`` (bos prepended)."""

from __future__ import annotations

from typing import Sequence

from megatrain.data.tokenizers.base import MegatrainTokenizer, TokenizerConfig, need_file

__all__ = [
    "GPTSentencePieceTokenizer", "Llama2Tokenizer", "SentencePieceTokenizer",
    "build_gpt_sentencepiece", "build_llama2", "build_sentencepiece",
]


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



def build_sentencepiece(cfg: TokenizerConfig) -> SentencePieceTokenizer:
    return SentencePieceTokenizer(
        need_file(cfg.tokenizer_model, "--tokenizer-model", "SentencePieceTokenizer"),
        vocab_extra_ids=cfg.vocab_extra_ids,
    )


def build_gpt_sentencepiece(cfg: TokenizerConfig) -> GPTSentencePieceTokenizer:
    return GPTSentencePieceTokenizer(need_file(cfg.tokenizer_model, "--tokenizer-model", "GPTSentencePieceTokenizer"))


def build_llama2(cfg: TokenizerConfig) -> Llama2Tokenizer:
    return Llama2Tokenizer(need_file(cfg.tokenizer_model, "--tokenizer-model", "Llama2Tokenizer"))
