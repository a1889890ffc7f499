"""The ``preprocess`` command line (``tools/preprocess_data.py``, ``megatrain preprocess``): Megatron's
flags, their `PreprocessConfig`, and `main`, which runs `preprocess` with SIGINT/SIGTERM turned into
a clean exit, turns errors into one ``error: ...`` line and prints the summary."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from megatrain.data.preprocess.config import PreprocessConfig, PreprocessError, PreprocessStats
from megatrain.data.preprocess.driver import preprocess
from megatrain.data.preprocess.signals import _Interrupted, _signals_interrupt
from megatrain.data.tokenizers import TokenizerConfig, add_tokenizer_args
from megatrain.flags import OneLineArgumentParser

__all__ = ["build_parser", "config_from_args", "find_optimal_num_workers", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="preprocess_data.py",
        description="Tokenize jsonl/text into Megatron .bin/.idx files.",
    )
    add_tokenizer_args(parser)
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True,
                       help="Input file or glob: jsonl (one JSON object per line), .txt/.text "
                            "(one document per line), or .gz of either.")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="Space separated list of keys to extract from json.")
    group.add_argument("--split-sentences", action="store_true", help="Split documents into sentences.")
    group.add_argument("--keep-newlines", action="store_true",
                       help="Keep newlines between sentences when splitting.")
    group.add_argument("--input-format", choices=["auto", "jsonl", "text"], default="auto",
                       help="Input format; auto: .txt/.text(.gz) are text, others jsonl.")
    group = parser.add_argument_group(title="tokenization process")
    group.add_argument("--append-eod", action="store_true",
                       help="Append an <eod> token to the end of a document.")
    group.add_argument("--lang", type=str, default="english",
                       help="Language for sentence splitting (the built-in splitter is for "
                            "languages written like English).")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True,
                       help="Path to binary output file without suffix.")
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, default=1, help="Number of worker processes to launch.")
    group.add_argument("--partitions", type=int, default=1,
                       help="Number of file partitions (output order as Megatron-LM's).")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="Keep input order even with --partitions > 1.")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="Interval (documents) between progress lines when there is no progress bar.")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="Skip malformed lines (bad JSON, missing key, non-UTF-8), count and report them.")
    group.add_argument("--no-progress", dest="progress", action="store_false",
                       help="No progress bar or progress lines.")
    group.add_argument("--find-optimal-num-workers", action="store_true",
                       help="Time short runs with each of --workers-to-check workers (each on the first "
                            "--max-documents documents, written to a temporary directory) and print them "
                            "fastest first, as Megatron-LM does; no output files are written.")
    group.add_argument("--workers-to-check", nargs="+", type=int, default=None,
                       help="Worker counts --find-optimal-num-workers times (default 16 32 64, as in "
                            "Megatron-LM); those not divisible by --partitions are left out.")
    group.add_argument("--max-documents", type=int, default=None,
                       help="Documents each --find-optimal-num-workers run processes (default 100000, as in "
                            "Megatron-LM; it stops at the end of the chunk reaching them); no effect without "
                            "--find-optimal-num-workers, as in Megatron-LM.")
    return parser


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    return PreprocessConfig(
        input=args.input,
        output_prefix=args.output_prefix,
        tokenizer=TokenizerConfig.from_namespace(args),
        json_keys=list(args.json_keys),
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        append_eod=args.append_eod,
        lang=args.lang,
        workers=args.workers,
        partitions=args.partitions,
        keep_sequential_samples=args.keep_sequential_samples,
        log_interval=args.log_interval,
        skip_bad_lines=args.skip_bad_lines,
        input_format=args.input_format,
        progress=args.progress,
    )


DEFAULT_WORKERS_TO_CHECK = [16, 32, 64]  # Megatron-LM's defaults
DEFAULT_MAX_DOCUMENTS = 100_000


def find_optimal_num_workers(cfg: PreprocessConfig, workers_to_check: Sequence[int],
                             max_documents: int) -> list[tuple[int, float]]:
    """Megatron-LM's --find-optimal-num-workers: one short run per worker count (the first
    ``max_documents`` documents, into a temporary directory); prints and returns ``(workers, docs/s)``
    fastest first."""
    import dataclasses
    import tempfile

    workers = []
    for n in workers_to_check:
        if n < 1 or n % cfg.partitions:
            print(f"Removing num_workers ({n}) from workers list because it's not divisible by num_partitions "
                  f"({cfg.partitions})")
        else:
            workers.append(n)
    if not workers:
        raise PreprocessError(f"--workers-to-check {' '.join(map(str, workers_to_check))}: no worker count is "
                              f"positive and divisible by --partitions {cfg.partitions}")
    results = []
    with tempfile.TemporaryDirectory(prefix="find_workers_") as tmp:
        for n in workers:
            print(f"Processing data with {n} workers.")
            trial = dataclasses.replace(cfg, workers=n, max_documents=max_documents, progress=False,
                                        output_prefix=os.path.join(tmp, f"w{n}"))
            stats = PreprocessStats()
            preprocess(trial, stats)
            results.append((n, stats.documents / max(stats.seconds, 1e-9)))
    results.sort(key=lambda r: r[1], reverse=True)
    print("\n-----------------------------------")
    print("Performance results (fastest -> slowest):")
    for i, (n, rate) in enumerate(results):
        print(f"{i + 1}. {n} workers -> avg. docs/s: {rate:.4f}")
    print("\n-----------------------------------")
    print(f"The most optimal num of workers is {results[0][0]} with avg. preprocessed docs/s: {results[0][1]:.4f}.")
    print("-----------------------------------")
    print(f"no output written to --output-prefix {cfg.output_prefix}: run again with --workers {results[0][0]}")
    return results


def main(argv: Sequence[str] | None = None) -> list[str]:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    if args.find_optimal_num_workers:
        max_documents = DEFAULT_MAX_DOCUMENTS if args.max_documents is None else args.max_documents
        if max_documents < 1:
            raise SystemExit(f"error: --max-documents must be at least 1, got {max_documents}")
        try:
            with _signals_interrupt():
                find_optimal_num_workers(cfg, args.workers_to_check or DEFAULT_WORKERS_TO_CHECK, max_documents)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        except KeyboardInterrupt as e:
            raise SystemExit(128 + e.signum if isinstance(e, _Interrupted) else 130) from None
        return []
    for flag, value in (("--max-documents", args.max_documents), ("--workers-to-check", args.workers_to_check)):
        if value is not None:
            print(f"note: {flag} has no effect without --find-optimal-num-workers (as in Megatron-LM)")
    stats = PreprocessStats()
    try:
        with _signals_interrupt():
            prefixes = preprocess(cfg, stats)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt as e:
        code = 128 + e.signum if isinstance(e, _Interrupted) else 130
        if stats.outputs_written:
            print("interrupted: the output files had already been written completely", file=sys.stderr)
        else:
            print("interrupted: no output files were written", file=sys.stderr)
        raise SystemExit(code) from None
    secs = max(stats.seconds, 1e-9)
    print(
        f"Processed {stats.documents} documents, {stats.tokens} tokens, {stats.bytes / 1024 / 1024:.2f} MB "
        f"in {stats.seconds:.2f}s ({stats.documents / secs:.1f} docs/s, {stats.tokens / secs:,.0f} tokens/s, "
        f"{stats.bytes / secs / 1024 / 1024:.2f} MB/s) with {cfg.workers} worker(s)."
    )
    if stats.empty_documents:
        print(f"{stats.empty_documents} empty document(s): no sequence written, document boundary kept.")
    if stats.blank_lines:
        print(f"{stats.blank_lines} blank line(s) skipped.")
    if stats.bad_lines:
        kinds = ", ".join(f"{n} {k}" for k, n in stats.bad_reasons.most_common())
        print(f"skipped {stats.bad_lines} bad line(s): {kinds}.")
    for p in prefixes:
        print(f"wrote {p}.bin and {p}.idx")
    return prefixes
