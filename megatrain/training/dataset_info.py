"""``tools/dataset_info.py``: what a dataset holds and which samples training will see.

`dataset_info(args)` prints, per dataset prefix, its documents, sequences, tokens and dtype,
the documents/tokens of each split, and the samples each split must provide for the training
flags given. `dump_samples(args, n, output)` writes the token ids of the first ``n`` training
samples in training order (int64 ``[n, seq_length + 1]``) to a ``.npy`` file, atomically. Both
take the namespace of ``pretrain_gpt.py``'s parser, so defaults are the same as in training.
It lives in ``training/``, beside ``checkpoint_info.py``, because its command line is the training
one, and ``data/`` imports nothing from ``training/``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import numpy as np

from megatrain.atomic_io import atomic_path
from megatrain.data.config import DataConfig
from megatrain.data.gpt_dataset import (
    SPLIT_NAMES,
    build_train_valid_test_datasets,
    num_samples_for_splits,
    parse_blend,
    parse_split,
    split_matrix_from_vector,
    split_ranges,
)

__all__ = ["dataset_info", "dump_samples", "build_info_parser", "main"]


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


def _prefix_lines(prefix: str, flag: str, matrix) -> list[str]:
    from megatrain.data.gpt_dataset import _open_indexed

    ds = _open_indexed(prefix, flag)
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


def dataset_info(args: argparse.Namespace, out=None) -> None:
    """Print documents/tokens/dtype per prefix, per-split sizes and the samples per split."""
    out = out or sys.stdout
    cfg = DataConfig.from_args(args)
    lines = []
    if cfg.mock_data:
        lines.append("mock data (synthetic tokens)")
    elif cfg.data_path:
        prefixes, weights = parse_blend(cfg.data_path, "--data-path")
        matrix = split_matrix_from_vector(parse_split(cfg.split))
        lines.append(f"split {cfg.split!r}: " + ", ".join(
            f"{n} {m[0]:.6f}-{m[1]:.6f}" if m else f"{n} empty" for n, m in zip(SPLIT_NAMES, matrix)))
        for k, p in enumerate(prefixes):
            if weights is not None:
                lines.append(f"weight {weights[k]}")
            lines += _prefix_lines(p, "--data-path", matrix)
    else:
        for flag, values in (("--train-data-path", cfg.train_data_path),
                             ("--valid-data-path", cfg.valid_data_path),
                             ("--test-data-path", cfg.test_data_path)):
            blend = parse_blend(values, flag)
            if blend:
                lines.append(flag)
                for p in blend[0]:
                    lines += _prefix_lines(p, flag, None)
    has_run_flags = (getattr(args, "train_iters", None) is not None or getattr(args, "train_samples", None))
    if has_run_flags and getattr(args, "seq_length", None):
        counts = _sample_counts(args)
        lines.append(f"samples needed (seq length {args.seq_length}, global batch "
                     f"{_global_batch_size(args)}): train {counts[0]}, valid {counts[1]}, test {counts[2]}")
    print("\n".join(lines), file=out)


def dump_samples(args: argparse.Namespace, n: int, output: str) -> np.ndarray:
    """Write the first ``n`` training samples (training order) to ``output`` (.npy); return them."""
    if not getattr(args, "seq_length", None):
        raise SystemExit("error: --seq-length is required")
    cfg = DataConfig.from_args(args)
    eod, vocab = _eod_and_vocab(args)
    train = build_train_valid_test_datasets(cfg, args.seq_length, args.seed, _sample_counts(args),
                                            vocab, eod)[0]
    if train is None:
        raise SystemExit("error: the run has no training split (check --split / --train-data-path)")
    if n > len(train):
        raise SystemExit(f"error: --dump-samples {n} is more than the {len(train)} training samples")
    samples = np.stack([train[i] for i in range(n)]).astype(np.int64) if n else \
        np.zeros((0, args.seq_length + 1), dtype=np.int64)
    with atomic_path(output) as tmp, open(tmp, "wb") as f:
        np.save(f, samples, allow_pickle=False)
    return samples


def build_info_parser() -> argparse.ArgumentParser:
    """``pretrain_gpt.py``'s parser plus ``--dump-samples N --output F.npy``."""
    from megatrain.training.arguments import build_parser

    p = build_parser(prog="dataset_info.py")
    g = p.add_argument_group("dataset_info")
    g.add_argument("--dump-samples", type=int, default=0, metavar="N",
                   help="write the first N training samples (training order) to --output")
    g.add_argument("--output", type=str, default=None, help=".npy file for --dump-samples")
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_info_parser().parse_args(argv)
    if args.micro_batch_size is None and getattr(args, "batch_size", None):
        args.micro_batch_size = args.batch_size
    try:
        dataset_info(args)
        if args.dump_samples:
            if not args.output:
                raise SystemExit("error: --dump-samples needs --output F.npy")
            samples = dump_samples(args, args.dump_samples, args.output)
            print(f"wrote {samples.shape[0]} samples of {samples.shape[1]} tokens to {args.output}")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
