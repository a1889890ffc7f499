"""``tools/dataset_info.py``: what a dataset holds and which samples training will see.

`dataset_info(args)` prints, per dataset prefix, its documents, sequences, tokens and dtype,
the documents/tokens of each split, and the samples each split must provide for the training
flags given. `dump_samples(args, n, output)` writes the first ``n`` training samples in training
order, atomically: for GPT the token ids (int64 ``[n, seq_length + 1]``) to a ``.npy`` file; for
BERT a ``.npz`` with one stacked int64 array per field, named as Megatron names them (``text``,
``types``, ``labels``, ``is_random``, ``padding_mask``, ``loss_mask``, ``truncated``). Both take the
namespace of ``pretrain_gpt.py``'s parser plus the BERT flags, so defaults are the same as in
training.

GPT or BERT: ``--model-family {gpt,bert}`` when given; else BERT when a BERT flag
(``--bert-no-binary-head``, ``--mask-prob``, ``--short-seq-prob``) is on the command line or
``--tokenizer-type`` is ``BertWordPieceLowerCase``/``BertWordPieceCase``; else GPT. BERT data is
split by documents and reported in documents and sentences.

It lives in ``training/``, beside ``checkpoint_info.py``, because its command line is the training
one, and ``data/`` imports nothing from ``training/``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import numpy as np

from megatrain.atomic_io import atomic_path
from megatrain.data.bert_dataset import BERT_TOKENIZER_TYPES, build_bert_datasets
from megatrain.data.config import DataConfig
from megatrain.data.dataset_builder import open_indexed
from megatrain.data.gpt_dataset import (
    SPLIT_NAMES,
    build_train_valid_test_datasets,
    num_samples_for_splits,
    parse_blend,
    parse_split,
    split_matrix_from_vector,
    split_ranges,
)
from megatrain.models.bert.flags import BERT_FLAGS, add_bert_flags

__all__ = ["BERT_FIELDS", "dataset_info", "dump_samples", "build_info_parser", "main", "model_family"]

#: The fields of a BERT sample, in Megatron's names (the arrays of a BERT ``--dump-samples`` file).
BERT_FIELDS = ("text", "types", "labels", "is_random", "padding_mask", "loss_mask", "truncated")


def _global_batch_size(args) -> int:
    gbs = getattr(args, "global_batch_size", None) or getattr(args, "micro_batch_size", None)
    if not gbs:
        raise SystemExit("error: give --global-batch-size (or --micro-batch-size)")
    return int(gbs)


def _sample_counts(args) -> tuple[int, int, int]:
    train_iters = getattr(args, "train_iters", None)
    train_samples = getattr(args, "train_samples", None)
    if train_iters is None and not train_samples:
        raise SystemExit("error: give --train-iters or --train-samples")
    return num_samples_for_splits(train_iters, train_samples, _global_batch_size(args),
                                  getattr(args, "eval_interval", 1000),
                                  getattr(args, "eval_iters", 100))


def _eod_and_vocab(args) -> tuple[Optional[int], Optional[int]]:
    if not getattr(args, "tokenizer_type", None):
        return None, getattr(args, "vocab_size", None)
    from megatrain.data.tokenizers import build_tokenizer

    tok = build_tokenizer(args)
    return tok.eod, tok.vocab_size


def model_family(args: argparse.Namespace, argv: Sequence[str] = ()) -> str:
    """``"bert"`` or ``"gpt"``: ``--model-family`` if given, else BERT when a BERT flag is in
    ``argv`` or the tokenizer is a BERT WordPiece type."""
    chosen = getattr(args, "model_family", None)
    if chosen:
        return chosen
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    if given & set(BERT_FLAGS) or getattr(args, "tokenizer_type", None) in BERT_TOKENIZER_TYPES:
        return "bert"
    return "gpt"


def _bert_prefix_lines(prefix: str, flag: str, matrix, binary_head: bool) -> list[str]:
    ds = open_indexed(prefix, flag)
    lengths = ds.sequence_lengths
    bounds = np.asarray(ds.document_indices, dtype=np.int64)
    per_doc = np.diff(bounds)
    tokens_cum = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    need = 2 if binary_head else 1
    lines = [f"dataset {prefix}",
             f"  documents: {ds.num_documents}  sentences: {len(ds)}  tokens: {int(tokens_cum[-1])}  "
             f"dtype: {ds.dtype.name}",
             f"  documents with at least {need} sentence(s): {int(np.sum(per_doc >= need))}  "
             f"sentences per document: at most {int(per_doc.max()) if per_doc.size else 0}"]
    if matrix is not None:
        for name, r in zip(SPLIT_NAMES, split_ranges(ds.num_documents, matrix)):
            if r is None:
                lines.append(f"  {name:5s}: empty")
            else:
                s0, s1 = int(bounds[r[0]]), int(bounds[r[1]])
                lines.append(f"  {name:5s}: documents [{r[0]}, {r[1]}) = {r[1] - r[0]}  sentences: "
                             f"{s1 - s0}  tokens: {int(tokens_cum[s1] - tokens_cum[s0])}")
    return lines


def _prefix_lines(prefix: str, flag: str, matrix) -> list[str]:
    ds = open_indexed(prefix, flag)
    lengths = ds.sequence_lengths
    lines = [f"dataset {prefix}",
             f"  documents: {ds.num_documents}  sequences: {len(ds)}  tokens: "
             f"{int(lengths.sum(dtype=np.int64))}  dtype: {ds.dtype.name}"]
    if matrix is not None:
        for name, r in zip(SPLIT_NAMES, split_ranges(len(ds), matrix)):
            if r is None:
                lines.append(f"  {name:5s}: empty")
            else:
                tokens = int(lengths[r[0]:r[1]].sum(dtype=np.int64))
                lines.append(f"  {name:5s}: sequences [{r[0]}, {r[1]}) = {r[1] - r[0]}  tokens: {tokens}")
    return lines


def dataset_info(args: argparse.Namespace, out=None, family: str = "gpt") -> None:
    """Print documents/tokens/dtype per prefix, per-split sizes and the samples per split
    (``family`` "bert": documents and sentences, split by documents)."""
    out = out or sys.stdout
    cfg = DataConfig.from_args(args)
    if family == "bert":
        binary_head = getattr(args, "bert_binary_head", True)
        prefix_lines = lambda p, flag, m: _bert_prefix_lines(p, flag, m, binary_head)  # noqa: E731
    else:
        prefix_lines = _prefix_lines
    lines = [] if family == "gpt" else ["BERT masked-LM data (split by documents)"]
    if cfg.mock_data:
        if family == "bert":
            raise SystemExit("error: --mock-data gives GPT token data only; BERT needs sentence-level "
                             "--data-path data (tools/preprocess_data.py --split-sentences)")
        lines.append("mock data (synthetic tokens)")
    elif cfg.data_path:
        prefixes, weights = parse_blend(cfg.data_path, "--data-path")
        matrix = split_matrix_from_vector(parse_split(cfg.split))
        lines.append(f"split {cfg.split!r}: " + ", ".join(
            f"{n} {m[0]:.6f}-{m[1]:.6f}" if m else f"{n} empty" for n, m in zip(SPLIT_NAMES, matrix)))
        for k, p in enumerate(prefixes):
            if weights is not None:
                lines.append(f"weight {weights[k]}")
            lines += prefix_lines(p, "--data-path", matrix)
    else:
        for flag, values in (("--train-data-path", cfg.train_data_path),
                             ("--valid-data-path", cfg.valid_data_path),
                             ("--test-data-path", cfg.test_data_path)):
            blend = parse_blend(values, flag)
            if blend:
                lines.append(flag)
                for p in blend[0]:
                    lines += prefix_lines(p, flag, None)
    has_run_flags = (getattr(args, "train_iters", None) is not None or getattr(args, "train_samples", None))
    if has_run_flags and getattr(args, "seq_length", None):
        counts = _sample_counts(args)
        lines.append(f"samples needed (seq length {args.seq_length}, global batch "
                     f"{_global_batch_size(args)}): train {counts[0]}, valid {counts[1]}, test {counts[2]}")
    print("\n".join(lines), file=out)


def _bert_train(args):
    from megatrain.data.tokenizers import build_tokenizer

    if getattr(args, "tokenizer_type", None) not in BERT_TOKENIZER_TYPES:
        raise SystemExit("error: BERT samples need --tokenizer-type BertWordPieceLowerCase or "
                         "BertWordPieceCase with --vocab-file")
    tok = build_tokenizer(args)
    return build_bert_datasets(DataConfig.from_args(args), tok, args.seq_length, args.seed,
                               _sample_counts(args), mask_prob=args.mask_prob,
                               short_seq_prob=args.short_seq_prob,
                               binary_head=args.bert_binary_head)[0]


def dump_samples(args: argparse.Namespace, n: int, output: str, family: str = "gpt"):
    """Write the first ``n`` training samples (training order) to ``output``; return them.

    GPT: int64 ``[n, seq_length + 1]`` as ``.npy``. BERT: a ``.npz`` of the `BERT_FIELDS`, each
    stacked over the samples (``[n, seq_length]``, ``is_random`` and ``truncated`` ``[n]``).
    """
    if not getattr(args, "seq_length", None):
        raise SystemExit("error: --seq-length is required")
    if family == "bert":
        train = _bert_train(args)
    else:
        cfg = DataConfig.from_args(args)
        eod, vocab = _eod_and_vocab(args)
        train = build_train_valid_test_datasets(cfg, args.seq_length, args.seed, _sample_counts(args),
                                                vocab, eod)[0]
    if train is None:
        raise SystemExit("error: the run has no training split (check --split / --train-data-path)")
    if n > len(train):
        raise SystemExit(f"error: --dump-samples {n} is more than the {len(train)} training samples")
    if family == "bert":
        got = [train[i] for i in range(n)]
        samples = {}
        for key in BERT_FIELDS:
            empty = np.zeros((0, args.seq_length) if key not in ("is_random", "truncated") else 0, np.int64)
            samples[key] = np.stack([np.asarray(s[key], dtype=np.int64) for s in got]) if n else empty
        with atomic_path(output) as tmp, open(tmp, "wb") as f:
            np.savez(f, **samples)
        return samples
    samples = np.stack([train[i] for i in range(n)]).astype(np.int64) if n else \
        np.zeros((0, args.seq_length + 1), dtype=np.int64)
    with atomic_path(output) as tmp, open(tmp, "wb") as f:
        np.save(f, samples, allow_pickle=False)
    return samples


def build_info_parser() -> argparse.ArgumentParser:
    """``pretrain_gpt.py``'s parser plus the BERT flags, ``--model-family`` and
    ``--dump-samples N --output F``."""
    from megatrain.training.arguments import build_parser

    p = build_parser(prog="dataset_info.py")
    if "--mask-prob" not in p._option_string_actions:
        add_bert_flags(p)
    g = p.add_argument_group("dataset_info")
    g.add_argument("--model-family", choices=("gpt", "bert"), default=None,
                   help="whose samples to show: gpt (token runs) or bert (masked-LM sentence pairs). "
                        "Default: bert when --bert-no-binary-head, --mask-prob or --short-seq-prob is "
                        "given or --tokenizer-type is BertWordPieceLowerCase/BertWordPieceCase, else gpt")
    g.add_argument("--dump-samples", type=int, default=0, metavar="N",
                   help="write the first N training samples (training order) to --output: GPT an int64 "
                        "[N, seq_length + 1] .npy, BERT an .npz of Megatron's fields (text, types, labels, "
                        "is_random, padding_mask, loss_mask, truncated)")
    g.add_argument("--output", type=str, default=None, help=".npy (GPT) or .npz (BERT) file for --dump-samples")
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_info_parser().parse_args(argv)
    if args.micro_batch_size is None and getattr(args, "batch_size", None):
        args.micro_batch_size = args.batch_size
    family = model_family(args, argv)
    try:
        dataset_info(args, family=family)
        if args.dump_samples:
            if not args.output:
                raise SystemExit(f"error: --dump-samples needs --output F.{'npz' if family == 'bert' else 'npy'}")
            samples = dump_samples(args, args.dump_samples, args.output, family=family)
            if family == "bert":
                print(f"wrote {args.dump_samples} BERT samples of {args.seq_length} tokens "
                      f"({', '.join(BERT_FIELDS)}) to {args.output}")
            else:
                print(f"wrote {samples.shape[0]} samples of {samples.shape[1]} tokens to {args.output}")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
