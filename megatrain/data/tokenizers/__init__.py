"""Tokenizers selected by Megatron-LM's ``--tokenizer-type``, behind one interface.

Every type implements :class:`MegatrainTokenizer` (``base.py``) and is built by
:func:`build_tokenizer` (``registry.py``, the table from type name to builder) from a
:class:`TokenizerConfig` or an argparse namespace carrying Megatron's flag names (see
:func:`add_tokenizer_args`). All of them read local files only; none downloads.

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
``SFTTokenizer``                  ``--tokenizer-model`` as HuggingFaceTokenizer, and
                                  ``--sft-tokenizer-prompt-format`` for ``--sft`` conversations
================================  ===========================================================

One module per kind: ``gpt2_bpe`` (GPT-2 BPE), ``huggingface`` (tokenizer.json),
``sentence_piece`` (the three SentencePiece types), ``tiktokenizer`` (TikTokenizer),
``wordpiece`` (both BERT types), ``null`` (NullTokenizer), ``sft`` (SFTTokenizer: Megatron's
prompt formats and loss targets of conversations).

How the GPT-2 BPE picks its engine (tiktoken or Hugging Face ``tokenizers``, the same ids) and
how very long pieces are encoded is told in ``gpt2_bpe``.

This package only re-exports; adding a type is one module and one line in ``registry.py``.
"""

from megatrain.data.tokenizers.base import MegatrainTokenizer, TokenizerConfig
from megatrain.data.tokenizers.gpt2_bpe import (
    GPT2_EOD,
    GPT2_PATTERN,
    GPT2BPETokenizer,
    bytes_to_unicode,
    load_gpt2_files,
)
from megatrain.data.tokenizers.huggingface import HuggingFaceTokenizer
from megatrain.data.tokenizers.null import NullTokenizer
from megatrain.data.tokenizers.registry import (
    TOKENIZER_BUILDERS,
    TOKENIZER_TYPES,
    add_tokenizer_args,
    build_tokenizer,
)
from megatrain.data.tokenizers.sentence_piece import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatrain.data.tokenizers.sft import SFTTokenizer
from megatrain.data.tokenizers.tiktokenizer import (
    TIKTOKEN_DEFAULT_SPECIAL_TOKENS,
    TIKTOKEN_PATTERN_V1,
    TIKTOKEN_PATTERN_V2,
    TikTokenizer,
)
from megatrain.data.tokenizers.wordpiece import BertWordPieceTokenizer

# The name megatrain.convert.tokenizer_files imports (from when this package was one module).
_load_gpt2_files = load_gpt2_files

__all__ = [
    "GPT2_EOD",
    "GPT2_PATTERN",
    "TIKTOKEN_DEFAULT_SPECIAL_TOKENS",
    "TIKTOKEN_PATTERN_V1",
    "TIKTOKEN_PATTERN_V2",
    "TOKENIZER_BUILDERS",
    "TOKENIZER_TYPES",
    "BertWordPieceTokenizer",
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "MegatrainTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "SFTTokenizer",
    "TikTokenizer",
    "TokenizerConfig",
    "add_tokenizer_args",
    "build_tokenizer",
    "bytes_to_unicode",
    "load_gpt2_files",
]
