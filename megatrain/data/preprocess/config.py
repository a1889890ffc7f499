"""What a preprocessing run is told and what it reports: `PreprocessConfig` (with its checks),
`PreprocessStats`, and `PreprocessError`, the user-facing error every module of the package raises."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from megatrain.data.tokenizers import TokenizerConfig

__all__ = ["PreprocessConfig", "PreprocessError", "PreprocessStats"]


class PreprocessError(ValueError):
    """A user-facing problem with the input or the flags."""


@dataclass
class PreprocessConfig:
    input: str
    output_prefix: str
    tokenizer: TokenizerConfig
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    split_sentences: bool = False
    keep_newlines: bool = False
    append_eod: bool = False
    lang: str = "english"
    workers: int = 1
    partitions: int = 1
    keep_sequential_samples: bool = False
    log_interval: int = 1000
    skip_bad_lines: bool = False
    #: "auto" (by file name), "jsonl" or "text"
    input_format: str = "auto"
    #: show a tqdm progress bar (when stderr is a terminal); else log lines every log_interval docs
    progress: bool = True
    #: stop reading after the chunk holding this many documents (--find-optimal-num-workers' trial runs)
    max_documents: int | None = None

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def output_prefixes(self) -> list[str]:
        return [f"{self.output_prefix}_{key}_{self.level}" for key in self.json_keys]


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    lines: int = 0
    blank_lines: int = 0
    empty_documents: int = 0
    empty_sentences: int = 0
    bad_lines: int = 0
    bad_reasons: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    #: True once every output is in place under its final name
    outputs_written: bool = False


def _check_config(cfg: PreprocessConfig) -> None:
    if cfg.workers < 1:
        raise PreprocessError(f"--workers must be at least 1, got {cfg.workers}")
    if cfg.partitions < 1:
        raise PreprocessError(f"--partitions must be at least 1, got {cfg.partitions}")
    if cfg.workers % cfg.partitions != 0:
        raise PreprocessError(
            f"--workers {cfg.workers} must be divisible by --partitions {cfg.partitions} (as in Megatron-LM)"
        )
    if cfg.max_documents is not None and cfg.max_documents < 1:
        raise PreprocessError(f"--max-documents must be at least 1, got {cfg.max_documents}")
    if not cfg.json_keys:
        raise PreprocessError("--json-keys needs at least one key")
    if len(set(cfg.json_keys)) != len(cfg.json_keys):
        raise PreprocessError(f"--json-keys has repeated keys: {cfg.json_keys}")
    if cfg.input_format not in ("auto", "jsonl", "text"):
        raise PreprocessError(f"unknown input format {cfg.input_format!r} (auto, jsonl or text)")
