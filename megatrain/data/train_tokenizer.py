"""``megatrain train-tokenizer``: train a GPT-2 style byte-level BPE on your own corpus.

Reads jsonl / text / ``.gz`` files (same input rules as preprocessing), trains with the
Hugging Face ``tokenizers`` library and writes ``vocab.json`` + ``merges.txt`` in GPT-2's
format, with ``<|endoftext|>`` as the end-of-document token. Use them with
``--tokenizer-type GPT2BPETokenizer --vocab-file D/vocab.json --merge-file D/merges.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from megatrain.atomic_io import atomic_write_text
from megatrain.data.preprocess import PreprocessError, iter_texts
from megatrain.flags import OneLineArgumentParser

__all__ = ["build_parser", "main", "train_tokenizer"]

EOD = "<|endoftext|>"
MIN_VOCAB = 257  # 256 bytes + <|endoftext|>


def train_tokenizer(
    inputs: str | Sequence[str],
    vocab_size: int,
    output_dir: str,
    json_keys: Sequence[str] = ("text",),
    min_frequency: int = 2,
    skip_bad_lines: bool = False,
) -> tuple[str, str]:
    """Train and write ``output_dir/vocab.json`` and ``output_dir/merges.txt``; returns both paths."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size <= MIN_VOCAB:
        raise ValueError(f"--vocab-size must be larger than {MIN_VOCAB} (256 bytes + {EOD}), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    tok.train_from_iterator(iter_texts(inputs, json_keys, skip_bad_lines), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    os.makedirs(output_dir, exist_ok=True)
    vocab_path = os.path.join(output_dir, "vocab.json")
    merges_path = os.path.join(output_dir, "merges.txt")
    atomic_write_text(vocab_path, json.dumps(vocab, ensure_ascii=False))
    atomic_write_text(merges_path, "#version: 0.2\n" + "".join(m + "\n" for m in merges))
    return vocab_path, merges_path


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="megatrain train-tokenizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="Input files or globs (jsonl, .txt/.text one document per line, .gz of either).")
    parser.add_argument("--vocab-size", type=int, required=True, help="Vocabulary size, including <|endoftext|>.")
    parser.add_argument("--output-dir", required=True, help="Where to write vocab.json and merges.txt.")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="Keys to read from jsonl.")
    parser.add_argument("--min-frequency", type=int, default=2, help="Minimum count of a merged pair.")
    parser.add_argument("--skip-bad-lines", action="store_true", help="Skip malformed input lines.")
    return parser


def main(argv: Sequence[str] | None = None) -> tuple[str, str]:
    args = build_parser().parse_args(argv)
    try:
        paths = train_tokenizer(args.input, args.vocab_size, args.output_dir, args.json_keys,
                                args.min_frequency, args.skip_bad_lines)
    except (ValueError, PreprocessError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {paths[0]} and {paths[1]}")
    print(f"use: --tokenizer-type GPT2BPETokenizer --vocab-file {paths[0]} --merge-file {paths[1]}")
    return paths


if __name__ == "__main__":
    main()
