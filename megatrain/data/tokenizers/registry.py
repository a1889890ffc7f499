"""The ``--tokenizer-type`` registry: :data:`TOKENIZER_BUILDERS` maps every type name to the
function that builds it from a :class:`TokenizerConfig`; :func:`build_tokenizer` looks the name up
and :func:`add_tokenizer_args` offers exactly the names in the table as the flag's choices.

Adding a tokenizer type is one module (a :class:`MegatrainTokenizer` and a ``build_*(cfg)``
function) and one line in the table below.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from megatrain.data.tokenizers import gpt2_bpe, huggingface, null, sentence_piece, sft, tiktokenizer, wordpiece
from megatrain.data.tokenizers.base import MegatrainTokenizer, TokenizerConfig
from megatrain.flags import flag_section

__all__ = ["TOKENIZER_BUILDERS", "TOKENIZER_TYPES", "add_tokenizer_args", "build_tokenizer"]

def build_mistral(cfg: TokenizerConfig) -> MegatrainTokenizer:
    """Megatron's ``MistralTokenizer`` wraps mistral-common (its ``tekken.json`` / ``tokenizer.model.v3``
    files), which megatrain does not read: a local Hugging Face tokenizer folder of the model
    (``tokenizer.json`` / ``tokenizer_config.json``, as the Hub's Mistral repositories have) is read as
    ``HuggingFaceTokenizer`` (a note says so); anything else is one line asking for that folder."""
    path = cfg.tokenizer_model
    hf_files = ("tokenizer.json", "tokenizer_config.json")
    if path and os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in hf_files):
        if int(os.environ.get("RANK", "0") or 0) == 0:
            print(f"note: --tokenizer-type MistralTokenizer: read as HuggingFaceTokenizer of {path} "
                  "(megatrain does not wrap mistral-common)", flush=True)
        tok = huggingface.build_huggingface(cfg)
        tok.name = "MistralTokenizer"  # the type the flags (and a checkpoint's args) name
        return tok
    if not path:
        found = "no --tokenizer-model"
    elif os.path.isfile(path):
        found = f"{os.path.basename(path)} is a file (mistral-common's, e.g. tekken.json)"
    elif os.path.isdir(path):
        found = "the folder has no tokenizer.json or tokenizer_config.json"
    else:
        found = "no such folder (a Hub name is not downloaded)"
    raise ValueError(f"--tokenizer-type MistralTokenizer --tokenizer-model {path}: {found}; megatrain does not wrap "
                     "mistral-common: pass the model's Hugging Face tokenizer folder (tokenizer.json, "
                     "tokenizer_config.json)")


#: ``--tokenizer-type`` name -> builder (the order is the order ``--help`` lists the choices in).
TOKENIZER_BUILDERS: dict[str, Callable[[TokenizerConfig], MegatrainTokenizer]] = {
    "BertWordPieceLowerCase": wordpiece.build_bert_lower_case,
    "BertWordPieceCase": wordpiece.build_bert_case,
    "GPT2BPETokenizer": gpt2_bpe.build_gpt2_bpe,
    "SentencePieceTokenizer": sentence_piece.build_sentencepiece,
    "GPTSentencePieceTokenizer": sentence_piece.build_gpt_sentencepiece,
    "Llama2Tokenizer": sentence_piece.build_llama2,
    "HuggingFaceTokenizer": huggingface.build_huggingface,
    "TikTokenizer": tiktokenizer.build_tiktokenizer,
    "NullTokenizer": null.build_null,
    "SFTTokenizer": sft.build_sft,
    "MistralTokenizer": build_mistral,  # Megatron's (mistral-common): a Hugging Face folder here
}

TOKENIZER_TYPES = tuple(TOKENIZER_BUILDERS)


def build_tokenizer(cfg: Any) -> MegatrainTokenizer:
    """Build the tokenizer named by ``cfg.tokenizer_type`` (a config, namespace or dict)."""
    cfg = TokenizerConfig.from_namespace(cfg)
    kind = cfg.tokenizer_type
    if kind is None:
        raise ValueError(f"--tokenizer-type is required; choose one of: {', '.join(TOKENIZER_TYPES)}")
    builder = TOKENIZER_BUILDERS.get(kind)
    if builder is None:
        raise ValueError(
            f"--tokenizer-type {kind!r} is not supported; choose one of: {', '.join(TOKENIZER_TYPES)}"
        )
    return builder(cfg)


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's tokenizer flags (same names, dests and defaults)."""
    group = flag_section(parser, "tokenizer")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="Size of vocab before EOD or padding (NullTokenizer, TikTokenizer).")
    group.add_argument("--vocab-file", type=str, default=None, help="Path to the vocab file.")
    group.add_argument("--merge-file", type=str, default=None, help="Path to the BPE merge file.")
    group.add_argument("--vocab-extra-ids", type=int, default=0,
                       help="Number of additional vocabulary tokens (T5 sentinels). Current Megatron-LM ignores it "
                            "for WordPiece (always 100 with BertWordPieceCase, none with BertWordPieceLowerCase); "
                            "here it is honoured for both: give 100 with BertWordPieceCase for Megatron's vocabulary.")
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
    group.add_argument("--sft-tokenizer-prompt-format", type=str, default=sft.DEFAULT_PROMPT_FORMAT,
                       help="SFTTokenizer: how --sft conversations render and which tokens are trained on "
                            "(Megatron's formats): " + ", ".join(sft.PROMPT_FORMATS) + " (the tokenizer's own "
                            "chat template, every token trained on)")
    return parser
