"""Data flags (Megatron-LM names, defaults and attribute names) and the typed `DataConfig`.

`add_data_flags(parser)` adds the data-and-dataloader flags of ``pretrain_gpt.py``;
`DataConfig.from_args(namespace)` turns a parsed namespace into the config the dataset
builders take. Sequence length, seed and batch sizes belong to the training arguments; they
are copied into `DataConfig` when the namespace has them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from megatrain.flags import flag_section
from megatrain.json_input import parse_json

__all__ = ["DataConfig", "add_data_flags", "DEFAULT_SPLIT"]

#: Megatron-LM's default ``--split``.
DEFAULT_SPLIT = "969, 30, 1"


def add_data_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add Megatron's data flags to ``parser`` (its "data and dataloader" section) and return the parser."""
    g = flag_section(parser, "data and dataloader")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="one dataset prefix, or a blend 'W1 PREFIX1 W2 PREFIX2 ...', or several "
                        "prefixes without weights (weighted by their sizes)")
    g.add_argument("--split", type=str, default=DEFAULT_SPLIT,
                   help="train,valid,test proportions of each --data-path dataset, e.g. '969,30,1'")
    g.add_argument("--train-data-path", nargs="*", default=None,
                   help="dataset(s) for training only (same forms as --data-path)")
    g.add_argument("--valid-data-path", nargs="*", default=None,
                   help="dataset(s) for validation only (same forms as --data-path)")
    g.add_argument("--test-data-path", nargs="*", default=None,
                   help="dataset(s) for testing only (same forms as --data-path)")
    g.add_argument("--data-args-path", type=str, default=None,
                   help="file holding the --data-path value (whitespace separated)")
    g.add_argument("--per-split-data-args-path", type=str, default=None,
                   help="JSON file with keys 'train', 'valid', 'test', each a --data-path value")
    g.add_argument("--data-cache-path", type=str, default=None,
                   help="where the index .npy files are cached (default: PREFIX/cache/GPTDataset_indices)")
    g.add_argument("--mock-data", action="store_true",
                   help="train on synthetic tokens instead of a dataset")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="accepted for compatibility; .bin files are always memory-mapped")
    g.add_argument("--mid-level-dataset-surplus", type=float, default=0.005,
                   help="extra fraction of samples built per blended dataset")
    g.add_argument("--num-workers", type=int, default=2, help="data loader worker processes")
    g.add_argument("--dataloader-type", default="single", choices=["single", "cyclic", "external"],
                   help="single: the dataset's order once (Megatron's default); cyclic: a new random order "
                        "each epoch, endlessly; external is not supported")
    g.add_argument("--no-data-sharding", action="store_false", dest="data_sharding",
                   help="with --dataloader-type cyclic: one permutation of all samples shared by the "
                        "data-parallel ranks instead of a bucket per rank")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="restart position ids after every end-of-document token")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="stop attention across end-of-document tokens")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="do not compute the loss on end-of-document tokens")
    g.add_argument("--sft", action="store_true",
                   help="Megatron SFT training: --data-path names jsonl files of {\"messages\": [...]} "
                        "conversations, one packed sample per line, the loss on the assistant's tokens; needs "
                        "--tokenizer-type SFTTokenizer (finetune_gpt.py: accepted, fine-tuning is implied)")
    return parser


def _read_data_args_file(path: str, flag: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().split()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None


@dataclass
class DataConfig:
    """Where the data comes from and how samples are formed."""

    data_path: Optional[list[str]] = None
    split: str = DEFAULT_SPLIT
    train_data_path: Optional[list[str]] = None
    valid_data_path: Optional[list[str]] = None
    test_data_path: Optional[list[str]] = None
    data_cache_path: Optional[str] = None
    mock_data: bool = False
    mmap_bin_files: bool = True
    mid_level_dataset_surplus: float = 0.005
    seq_length: Optional[int] = None
    seed: int = 1234
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    num_workers: int = 2

    @property
    def has_per_split_paths(self) -> bool:
        return any([self.train_data_path, self.valid_data_path, self.test_data_path])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DataConfig":
        """Build from a namespace made by a parser that has `add_data_flags` flags."""
        get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
        data_path = get("data_path")
        train, valid, test = get("train_data_path"), get("valid_data_path"), get("test_data_path")
        if get("data_args_path"):
            if data_path:
                raise ValueError("give either --data-path or --data-args-path, not both")
            data_path = _read_data_args_file(get("data_args_path"), "--data-args-path")
        if get("per_split_data_args_path"):
            path = get("per_split_data_args_path")
            if data_path or train or valid or test:
                raise ValueError("--per-split-data-args-path cannot be combined with --data-path "
                                 "or --train/valid/test-data-path")
            try:
                with open(path, "rb") as f:
                    spec = parse_json(f.read())
            except OSError as e:
                raise ValueError(f"--per-split-data-args-path: cannot read {path}: {e.strerror}") from None
            except ValueError as e:
                raise ValueError(f"--per-split-data-args-path: {path} is not valid JSON: {e}") from None
            if not isinstance(spec, dict):
                raise ValueError(f"--per-split-data-args-path: {path} must hold an object "
                                 "with keys 'train', 'valid', 'test'")
            as_list = lambda v: v.split() if isinstance(v, str) else (list(map(str, v)) if v else None)  # noqa: E731
            train, valid, test = (as_list(spec.get(k)) for k in ("train", "valid", "test"))
        return cls(
            data_path=list(data_path) if data_path else None,
            split=get("split", DEFAULT_SPLIT) or DEFAULT_SPLIT,
            train_data_path=list(train) if train else None,
            valid_data_path=list(valid) if valid else None,
            test_data_path=list(test) if test else None,
            data_cache_path=get("data_cache_path"),
            mock_data=bool(get("mock_data", False)),
            mmap_bin_files=bool(get("mmap_bin_files", True)),
            mid_level_dataset_surplus=float(get("mid_level_dataset_surplus", 0.005)),
            seq_length=get("seq_length"),
            seed=get("seed", 1234) if get("seed") is not None else 1234,
            reset_position_ids=bool(get("reset_position_ids", False)),
            reset_attention_mask=bool(get("reset_attention_mask", False)),
            eod_mask_loss=bool(get("eod_mask_loss", False)),
            num_workers=int(get("num_workers", 2)),
        )

    def describe_source(self) -> str:
        if self.mock_data:
            return "mock data"
        if self.data_path:
            return "--data-path " + " ".join(self.data_path)
        parts = []
        for flag, v in (("--train-data-path", self.train_data_path),
                        ("--valid-data-path", self.valid_data_path),
                        ("--test-data-path", self.test_data_path)):
            if v:
                parts.append(f"{flag} {' '.join(v)}")
        return " ".join(parts) or "no data"
