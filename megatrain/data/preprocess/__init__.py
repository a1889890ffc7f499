"""jsonl / plain text -> Megatron ``.bin/.idx`` (``tools/preprocess_data.py``).

Reads ``--input`` (a file, a glob, ``.gz`` of either; ``.txt``/``.text`` files are plain text
with one document per line, anything else is jsonl), tokenizes each ``--json-keys`` field in
``--workers`` processes, and writes ``{output_prefix}_{key}_{document|sentence}.bin/.idx``
byte-identical to Megatron-LM's for the same token ids.

Behaviour worth knowing (also in docs/data.md):

* Order is preserved: documents are written in input order (files in sorted glob order).
  With ``--partitions P > 1`` (and no ``--keep-sequential-samples``) the output order is
  Megatron's: input line ``i`` goes to partition ``i % P`` and partitions are concatenated.
* An empty document (no tokens) adds no sequence but keeps a document boundary, as
  Megatron-LM's ``add_document`` does; empty sentences are dropped. Both are counted.
* Blank lines in jsonl files are skipped and counted. Malformed JSON, a missing key, a value
  that is not text, non-UTF-8 bytes or text the tokenizer rejects stop the run with
  ``FILE:LINE: reason``; ``--skip-bad-lines`` skips such lines, counts them and reports.
* Outputs appear only when complete: a crash, Ctrl-C or SIGTERM leaves no ``.bin/.idx``
  under the final names (and no temporary files); with several outputs (``--json-keys``)
  they are renamed together once all are complete. An interrupted or failed run removes
  only files it created itself.
* Each output prefix is locked (``PREFIX.lock``, naming the holder) for the whole run: a
  second run on the same prefix stops at once with one line saying who holds it.

One module per concern: ``config`` (`PreprocessConfig`, `PreprocessStats`, `PreprocessError`),
``inputs`` (files, chunks of lines, one line's texts, `iter_texts`), ``encode`` (sentence splitting
and tokenizing a chunk), ``workers`` (the ordered worker pool), ``outputs`` (the output directory,
the prefix locks, publishing all outputs together and rolling back), ``signals`` (SIGINT/SIGTERM in
the main process and the workers), ``driver`` (`preprocess`, one run) and ``command`` (the flags and
`main`). The names of `__all__` below are importable from here.
"""

from __future__ import annotations

from megatrain.data.preprocess.command import build_parser, config_from_args, main
from megatrain.data.preprocess.config import PreprocessConfig, PreprocessError, PreprocessStats
from megatrain.data.preprocess.driver import preprocess
from megatrain.data.preprocess.encode import split_sentences
from megatrain.data.preprocess.inputs import expand_inputs, input_format_of, iter_texts, parse_line

__all__ = [
    "PreprocessConfig",
    "PreprocessError",
    "PreprocessStats",
    "build_parser",
    "config_from_args",
    "expand_inputs",
    "input_format_of",
    "iter_texts",
    "main",
    "parse_line",
    "preprocess",
    "split_sentences",
]
