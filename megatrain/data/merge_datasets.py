"""Join several ``.bin/.idx`` datasets into one (``tools/merge_datasets.py``).

``--input DIR`` merges every prefix in the directory in sorted order, as Megatron-LM's tool
does; ``--input PREFIX [PREFIX ...]`` merges the listed prefixes in the given order. All
inputs must share one dtype. The output appears only when complete.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from megatrain.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, bin_path, idx_path
from megatrain.flags import OneLineArgumentParser

__all__ = ["build_parser", "find_prefixes", "main", "merge_datasets"]


def find_prefixes(inputs: Sequence[str]) -> list[str]:
    """Dataset prefixes from one directory (sorted) or from a list of prefixes."""
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        folder = inputs[0]
        stems = set()
        for name in os.listdir(folder):
            stem, ext = os.path.splitext(name)
            if ext not in (".bin", ".idx") or not os.path.isfile(os.path.join(folder, name)):
                continue
            other = ".idx" if ext == ".bin" else ".bin"
            if not os.path.isfile(os.path.join(folder, stem + other)):
                raise ValueError(f"--input {folder}: {os.path.join(folder, name)} has no matching {other} file")
            stems.add(stem)
        if not stems:
            raise ValueError(f"--input {folder}: the directory holds no .bin/.idx pairs")
        return [os.path.join(folder, s) for s in sorted(stems)]
    prefixes = []
    for p in inputs:
        for ext in (".bin", ".idx"):
            if p.endswith(ext) and not os.path.exists(p + ".idx"):
                p = p[: -len(ext)]
        missing = [f for f in (bin_path(p), idx_path(p)) if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"--input {p}: missing {', '.join(missing)}")
        prefixes.append(p)
    return prefixes


def merge_datasets(prefixes: Sequence[str], output_prefix: str) -> str:
    """Concatenate the datasets (sequences and document boundaries) into ``output_prefix``."""
    if not prefixes:
        raise ValueError("nothing to merge: no input datasets")
    out = os.path.abspath(output_prefix)
    for p in prefixes:
        if os.path.abspath(p) == out:
            raise ValueError(f"--output-prefix {output_prefix} is also an input; choose another name")
    datasets = [IndexedDataset(p) for p in prefixes]
    dtypes = {d.dtype for d in datasets}
    if len(dtypes) > 1:
        listing = ", ".join(f"{d.prefix} ({d.dtype.name})" for d in datasets)
        raise ValueError(f"cannot merge datasets of different dtypes: {listing}")
    dtype = datasets[0].dtype
    del datasets
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        for p in prefixes:
            writer.add_index(p)
    return output_prefix


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="merge_datasets.py", description="Merge .bin/.idx datasets into one.")
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, nargs="+", required=True,
                       help="Directory containing all datasets to merge (merged in sorted order), "
                            "or a list of dataset prefixes (merged in the given order).")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True,
                       help="Path to binary output file without suffix.")
    group = parser.add_argument_group(title="miscellaneous")
    group.add_argument("--multimodal", action="store_true",
                       help="Accepted for compatibility; multimodal datasets are not supported.")
    return parser


def main(argv: Sequence[str] | None = None) -> str:
    args = build_parser().parse_args(argv)
    if args.multimodal:
        raise SystemExit("error: --multimodal datasets are not supported")
    try:
        prefixes = find_prefixes(args.input)
        out = merge_datasets(prefixes, args.output_prefix)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    ds = IndexedDataset(out)
    print(f"merged {len(prefixes)} dataset(s) into {out}.bin/.idx: {len(ds)} sequences, "
          f"{ds.num_documents} documents, {ds.num_tokens} tokens ({ds.dtype.name})", file=sys.stdout)
    return out


if __name__ == "__main__":
    main()
