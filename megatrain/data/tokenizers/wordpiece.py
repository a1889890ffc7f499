"""BERT WordPiece from a vocab.txt (``--tokenizer-type BertWordPieceLowerCase`` and
``BertWordPieceCase``), on Hugging Face ``tokenizers``, with Megatron-LM's special-token conventions.

As Megatron-LM's tokenizer (a Hugging Face ``BertTokenizer`` over the vocab.txt): the vocabulary is
the file's tokens, plus ``<extra_id_i>`` sentinels with ``--vocab-extra-ids`` (T5's; appended in
order after the file's tokens unless the file has them, and listed by ``additional_special_tokens``
and ``additional_special_tokens_ids``); the beginning and end of a sequence are ``[CLS]`` and
``[SEP]`` (``bos``, and ``eos`` = ``eod``). Texts are never wrapped in special tokens. (Megatron's older tokenizer appended ``[BOS]`` and ``[EOS]`` to the vocabulary; the
masked-LM data draws its random replacements from the whole vocabulary, so the two give different
samples.)"""

from __future__ import annotations

from typing import Sequence

from megatrain.data.tokenizers.base import MegatrainTokenizer, TokenizerConfig, need_file

__all__ = ["BertWordPieceTokenizer", "build_bert_case", "build_bert_lower_case"]


class BertWordPieceTokenizer(MegatrainTokenizer):
    """BERT WordPiece from a vocab.txt (HF ``tokenizers``), Megatron's conventions: ids without
    [CLS]/[SEP]; ``<extra_id_i>`` appended when missing; bos is ``[CLS]``, eos and eod ``[SEP]``."""

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
        self._extra = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for t in self._extra:
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
        return self.sep

    @property
    def eos(self) -> int:
        return self.sep

    @property
    def bos(self) -> int:
        return self.cls

    @property
    def pad(self) -> int:
        return self._vocab["[PAD]"]

    @property
    def additional_special_tokens(self) -> list[str]:
        """The ``--vocab-extra-ids`` sentinels, ``<extra_id_0>`` first."""
        return list(self._extra)

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        """Their ids, in the same order (the sentinels T5 samples use one after another)."""
        return [self._vocab[t] for t in self._extra]

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



def _build_bert(cfg: TokenizerConfig, lower_case: bool) -> BertWordPieceTokenizer:
    kind = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
    return BertWordPieceTokenizer(
        need_file(cfg.vocab_file, "--vocab-file", kind), lower_case=lower_case, vocab_extra_ids=cfg.vocab_extra_ids
    )


def build_bert_lower_case(cfg: TokenizerConfig) -> BertWordPieceTokenizer:
    return _build_bert(cfg, lower_case=True)


def build_bert_case(cfg: TokenizerConfig) -> BertWordPieceTokenizer:
    return _build_bert(cfg, lower_case=False)
