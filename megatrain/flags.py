"""The sections of ``--help`` that several concerns add flags to.

Each concern owns its flags and adds them with a function in its own package
(``megatrain/models/gpt/flags.py``, ``megatrain/parallel/flags.py``, ``megatrain/runtime/flags.py``,
``megatrain/checkpoint/flags.py``, ``megatrain/training/flags.py``, ``megatrain/data/config.py``,
...). Some sections hold flags of several concerns (``training`` holds the loop's, recomputation's,
compilation's and the CUDA graphs' flags), so a concern asks for a section by title with
:func:`flag_section` instead of creating it: the pre-training parser
(`megatrain.training.arguments.build_parser`) creates its sections first, in the order ``--help``
lists them; a tool's own parser gets the section created on first use. Every command's parser is an
:class:`OneLineArgumentParser`: a bad flag is one line.
"""

from __future__ import annotations

import argparse

__all__ = ["OneLineArgumentParser", "flag_section"]


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes (a bad value, a missing argument, an unknown flag) are one line,
    ``PROG: error: ...``, without the usage summary before it (``--help`` prints that)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def flag_section(parser: argparse.ArgumentParser, title: str) -> "argparse._ArgumentGroup":
    """The argument group of ``parser`` titled ``title``, created (last) when there is none."""
    for group in parser._action_groups:
        if group.title == title:
            return group  # type: ignore[return-value]
    return parser.add_argument_group(title)
