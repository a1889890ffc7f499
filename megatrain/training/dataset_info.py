"""``tools/dataset_info.py``: what a dataset holds and which samples training will see.

`dataset_info(args)` prints, per dataset prefix, its documents, sequences, tokens and dtype,
the documents/tokens of each split, and the samples each split must provide for the training
flags given. `dump_samples(args, n, output)` writes the first ``n`` training samples in training
order, atomically: for GPT the token ids (int64 ``[n, seq_length + 1]``) to a ``.npy`` file; for
BERT and T5 a ``.npz`` with one stacked int64 array per field, named as Megatron names them (BERT:
``text``, ``types``, ``labels``, ``is_random``, ``padding_mask``, ``loss_mask``, ``truncated``; T5:
``text_enc``, ``text_dec``, ``labels``, ``loss_mask``, ``truncated``, ``enc_mask``, ``dec_mask``).
Both take the namespace of ``pretrain_gpt.py``'s parser plus the BERT and T5 flags, so defaults
are the same as in training.

GPT, BERT or T5: ``--model-family {gpt,bert,t5}`` when given; else T5 when a T5 flag
(``--encoder-seq-length``, ``--decoder-seq-length``, ``--encoder-num-layers``,
``--decoder-num-layers``) is on the command line; else BERT when a BERT flag
(``--bert-no-binary-head``, ``--mask-prob``, ``--short-seq-prob``) is or ``--tokenizer-type`` is
``BertWordPieceLowerCase``/``BertWordPieceCase``; else GPT. BERT and T5 data are split by documents
and reported in documents and sentences. T5's encoder length is ``--encoder-seq-length`` (or
``--seq-length``, as Megatron takes either).

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
from megatrain.data.t5_dataset import T5_FIELDS, build_t5_datasets
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

__all__ = ["BERT_FIELDS", "T5_FIELDS", "T5_FLAGS", "dataset_info", "dump_samples", "build_info_parser", "main",
           "model_family"]

#: The fields of a BERT sample, in Megatron's names (the arrays of a BERT ``--dump-samples`` file).
BERT_FIELDS = ("text", "types", "labels", "is_random", "padding_mask", "loss_mask", "truncated")
#: Flags only a T5 command line has (they tell one).
T5_FLAGS = ("--encoder-seq-length", "--decoder-seq-length", "--encoder-num-layers", "--decoder-num-layers")
_FIELDS = {"bert": BERT_FIELDS, "t5": T5_FIELDS}


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
    """``"t5"``, ``"bert"`` or ``"gpt"``: ``--model-family`` if given, else T5 when a T5 flag is in
    ``argv``, else BERT when a BERT flag is or the tokenizer is a BERT WordPiece type."""
    chosen = getattr(args, "model_family", None)
    if chosen:
        return chosen
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    if given & set(T5_FLAGS):
        return "t5"
    if given & set(BERT_FLAGS) or getattr(args, "tokenizer_type", None) in BERT_TOKENIZER_TYPES:
        return "bert"
    return "gpt"


def _encoder_seq_length(args) -> Optional[int]:
    """T5's encoder length: ``--encoder-seq-length`` or ``--seq-length`` (Megatron takes either)."""
    enc, seq = getattr(args, "encoder_seq_length", None), getattr(args, "seq_length", None)
    if enc is not None and seq is not None and enc != seq:
        raise SystemExit(f"error: give --encoder-seq-length ({enc}) or --seq-length ({seq}), not both")
    return enc if enc is not None else seq


def _seq_length(args, family: str) -> Optional[int]:
    return _encoder_seq_length(args) if family == "t5" else getattr(args, "seq_length", None)


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
    if family in ("bert", "t5"):
        binary_head = family == "bert" and getattr(args, "bert_binary_head", True)
        prefix_lines = lambda p, flag, m: _bert_prefix_lines(p, flag, m, binary_head)  # noqa: E731
    else:
        prefix_lines = _prefix_lines
    lines = {"gpt": [], "bert": ["BERT masked-LM data (split by documents)"],
             "t5": ["T5 span-corruption data (split by documents)"]}[family]
    if cfg.mock_data:
        if family != "gpt":
            raise SystemExit(f"error: --mock-data gives GPT token data only; {family.upper()} needs "
                             "sentence-level --data-path data (tools/preprocess_data.py --split-sentences)")
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
    seq_length = _seq_length(args, family)
    if has_run_flags and seq_length:
        counts = _sample_counts(args)
        what = (f"encoder {seq_length}, decoder {getattr(args, 'decoder_seq_length', None)}" if family == "t5"
                else f"seq length {seq_length}")
        lines.append(f"samples needed ({what}, global batch "
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


def _t5_train(args):
    from megatrain.data.tokenizers import build_tokenizer

    if getattr(args, "tokenizer_type", None) not in BERT_TOKENIZER_TYPES:
        raise SystemExit("error: T5 samples need --tokenizer-type BertWordPieceCase or "
                         "BertWordPieceLowerCase with --vocab-file and --vocab-extra-ids")
    if getattr(args, "decoder_seq_length", None) is None:
        raise SystemExit("error: T5 samples need --decoder-seq-length")
    tok = build_tokenizer(args)
    return build_t5_datasets(DataConfig.from_args(args), tok, _encoder_seq_length(args),
                             args.decoder_seq_length, args.seed, _sample_counts(args),
                             mask_prob=args.mask_prob, short_seq_prob=args.short_seq_prob)[0]


def _field_shape(family: str, key: str, args) -> tuple:
    if key in ("is_random", "truncated"):
        return ()
    if family == "t5":
        return (_encoder_seq_length(args),) if key in ("text_enc", "enc_mask") else (args.decoder_seq_length,)
    return (args.seq_length,)


def dump_samples(args: argparse.Namespace, n: int, output: str, family: str = "gpt"):
    """Write the first ``n`` training samples (training order) to ``output``; return them.

    GPT: int64 ``[n, seq_length + 1]`` as ``.npy``. BERT and T5: a ``.npz`` of the `BERT_FIELDS`
    / `T5_FIELDS`, each stacked over the samples (BERT ``[n, seq_length]``; T5 ``text_enc`` and
    ``enc_mask`` ``[n, encoder_seq_length]``, the others ``[n, decoder_seq_length]``; the ints
    ``[n]``).
    """
    if not _seq_length(args, family):
        raise SystemExit("error: --encoder-seq-length is required" if family == "t5" else
                         "error: --seq-length is required")
    if family == "bert":
        train = _bert_train(args)
    elif family == "t5":
        train = _t5_train(args)
    else:
        cfg = DataConfig.from_args(args)
        eod, vocab = _eod_and_vocab(args)
        train = build_train_valid_test_datasets(cfg, args.seq_length, args.seed, _sample_counts(args),
                                                vocab, eod)[0]
    if train is None:
        raise SystemExit("error: the run has no training split (check --split / --train-data-path)")
    if n > len(train):
        raise SystemExit(f"error: --dump-samples {n} is more than the {len(train)} training samples")
    if family in _FIELDS:
        got = [train[i] for i in range(n)]
        samples = {}
        for key in _FIELDS[family]:
            empty = np.zeros((0, *_field_shape(family, key, args)), np.int64)
            samples[key] = np.stack([np.asarray(s[key], dtype=np.int64) for s in got]) if n else empty
        with atomic_path(output) as tmp, open(tmp, "wb") as f:
            np.savez(f, **samples)
        return samples
    samples = np.stack([train[i] for i in range(n)]).astype(np.int64) if n else \
        np.zeros((0, args.seq_length + 1), dtype=np.int64)
    with atomic_path(output) as tmp, open(tmp, "wb") as f:
        np.save(f, samples, allow_pickle=False)
    return samples


def _add_flags(p: argparse.ArgumentParser, add_flags) -> None:
    """A script's ``add_flags`` on ``p``; where ``p`` has some of them already (the BERT and T5 scripts
    both add ``--mask-prob``), only the others, and ``p``'s definitions stay."""
    scratch = argparse.ArgumentParser(add_help=False)
    add_flags(scratch)
    if not any(flag in p._option_string_actions for a in scratch._actions for flag in a.option_strings):
        add_flags(p)  # on the parser itself: a script may also extend a general flag (T5's positions)
        return
    from megatrain.flags import flag_section

    for group in scratch._action_groups:
        for action in group._group_actions:
            if not any(flag in p._option_string_actions for flag in action.option_strings):
                flag_section(p, group.title)._add_action(action)


def _add_script_flags(p: argparse.ArgumentParser) -> None:
    """The T5 script's flags (the T5 family's, so that a whole ``pretrain_t5.py`` command line
    parses; at least Megatron's ``--encoder-seq-length`` / ``--decoder-seq-length``, default None),
    then the BERT script's."""
    from megatrain.flags import flag_section
    from megatrain.models.registry import get_family

    try:
        t5_flags = get_family("t5").add_flags
    except (ValueError, ImportError):  # a megatrain without the T5 family
        t5_flags = None
    if t5_flags is not None:
        _add_flags(p, t5_flags)
    g = flag_section(p, "data and dataloader")
    if "--encoder-seq-length" not in p._option_string_actions:
        g.add_argument("--encoder-seq-length", type=int, default=None,
                       help="T5: the encoder's sequence length (or --seq-length)")
    if "--decoder-seq-length" not in p._option_string_actions:
        g.add_argument("--decoder-seq-length", type=int, default=None, help="T5: the decoder's sequence length")
    _add_flags(p, add_bert_flags)


def build_info_parser() -> argparse.ArgumentParser:
    """``pretrain_gpt.py``'s parser plus the BERT and T5 flags, ``--model-family`` and
    ``--dump-samples N --output F``."""
    from megatrain.training.arguments import build_parser

    p = build_parser(prog="dataset_info.py")
    _add_script_flags(p)
    g = p.add_argument_group("dataset_info")
    g.add_argument("--model-family", choices=("gpt", "bert", "t5"), default=None,
                   help="whose samples to show: gpt (token runs), bert (masked-LM sentence pairs) or t5 "
                        "(span corruption). Default: t5 when --encoder-seq-length, --decoder-seq-length, "
                        "--encoder-num-layers or --decoder-num-layers is given; else bert when "
                        "--bert-no-binary-head, --mask-prob or --short-seq-prob is given or --tokenizer-type "
                        "is BertWordPieceLowerCase/BertWordPieceCase; else gpt")
    g.add_argument("--dump-samples", type=int, default=0, metavar="N",
                   help="write the first N training samples (training order) to --output: GPT an int64 "
                        "[N, seq_length + 1] .npy, BERT and T5 an .npz of Megatron's fields (BERT: text, "
                        "types, labels, is_random, padding_mask, loss_mask, truncated; T5: text_enc, "
                        "text_dec, labels, loss_mask, truncated, enc_mask, dec_mask)")
    g.add_argument("--output", type=str, default=None,
                   help=".npy (GPT) or .npz (BERT, T5) file for --dump-samples")
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_info_parser().parse_args(argv)
    if args.micro_batch_size is None and getattr(args, "batch_size", None):
        args.micro_batch_size = args.batch_size
    family = model_family(args, argv)
    if getattr(args, "sft", False):
        raise SystemExit("error: dataset_info.py reads .bin/.idx datasets; --sft conversations (jsonl) are not "
                         "supported here (a bad line is named when pretrain_gpt.py --sft starts)")
    try:
        dataset_info(args, family=family)
        if args.dump_samples:
            if not args.output:
                raise SystemExit(f"error: --dump-samples needs --output F.{'npy' if family == 'gpt' else 'npz'}")
            samples = dump_samples(args, args.dump_samples, args.output, family=family)
            if family == "bert":
                print(f"wrote {args.dump_samples} BERT samples of {args.seq_length} tokens "
                      f"({', '.join(BERT_FIELDS)}) to {args.output}")
            elif family == "t5":
                print(f"wrote {args.dump_samples} T5 samples of {_encoder_seq_length(args)} encoder and "
                      f"{args.decoder_seq_length} decoder tokens ({', '.join(T5_FIELDS)}) to {args.output}")
            else:
                print(f"wrote {samples.shape[0]} samples of {samples.shape[1]} tokens to {args.output}")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
