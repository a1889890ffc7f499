"""Writes docs/megatron_flags.md: every flag pretrain_gpt.py accepts, and the Megatron flags it refuses."""

from __future__ import annotations

import argparse
import sys

from megatrain.atomic_io import atomic_write_text
from megatrain.training.arguments import build_parser
from megatrain.training.compat_flags import LEGACY_FLAG_NOTES, UNSUPPORTED_FLAGS

HEADER = """# Megatron-LM flags in megatrain

Generated from the parser by `python -m megatrain.training.flag_table docs/megatron_flags.md`;
a unit test keeps it in step with the code. Status:

- **supported**: does what Megatron-LM's flag does;
- **compatibility**: accepted so old scripts run; the note says what it means here;
- **not supported**: refused with the reason shown (the run does not start).

"""


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return ""
    d = action.default
    return "" if d is None or d == argparse.SUPPRESS else f"`{d}`"


def render() -> str:
    parser = build_parser()
    lines = [HEADER]
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            flags = [o for o in action.option_strings if o.startswith("--")]
            if not flags or flags[0] == "--help":
                continue
            legacy = next((LEGACY_FLAG_NOTES[f] for f in flags if f in LEGACY_FLAG_NOTES), None)
            status = f"compatibility: {legacy}" if legacy else "supported"
            help_text = (action.help or "").replace("|", "\\|").replace("%%", "%")
            rows.append(f"| `{', '.join(flags)}` | {_default(action)} | {status} | {help_text} |")
        if rows:
            lines.append(f"## {group.title}\n\n| flag | default | status | meaning |\n|---|---|---|---|")
            lines.extend(rows)
            lines.append("")
    lines.append("## Megatron-LM flags that are not supported\n\n| flag | reason |\n|---|---|")
    lines.extend(f"| `{flag}` | {reason} |" for flag, reason in sorted(UNSUPPORTED_FLAGS.items()))
    lines.append("")
    lines.append("Any other flag is refused as unknown, with the closest known flag suggested.\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out = argv[0] if argv else "docs/megatron_flags.md"
    atomic_write_text(out, render())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
