"""Writes docs/megatron_flags.md: every flag pretrain_gpt.py accepts, each model family's script's own
flags (pretrain_bert.py's, pretrain_t5.py's, pretrain_vlm.py's), and the Megatron flags it refuses."""

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


def _row(action: argparse.Action) -> str | None:
    flags = [o for o in action.option_strings if o.startswith("--")]
    if not flags or flags[0] == "--help":
        return None
    legacy = next((LEGACY_FLAG_NOTES[f] for f in flags if f in LEGACY_FLAG_NOTES), None)
    # a family's flag may say its own status (``action.status``: LLaVA's flags of what is not built)
    status = getattr(action, "status", None) or (f"compatibility: {legacy}" if legacy else "supported")
    help_text = (action.help or "").replace("|", "\\|").replace("%%", "%")
    return f"| `{', '.join(flags)}` | {_default(action)} | {status} | {help_text} |"


def _family_sections() -> list[str]:
    """Each family script's own flags (those its parser adds to the general one) and changed defaults."""
    from megatrain.models.registry import DEFAULT_FAMILY, family_names, get_family
    from megatrain.training.main import family_parser

    general_parser = build_parser()
    general = {o for a in general_parser._actions for o in a.option_strings}
    general_actions = {o: a for a in general_parser._actions for o in a.option_strings}
    lines = []
    for name in family_names():
        family = get_family(name)
        if name == DEFAULT_FAMILY or (family.add_flags is None and not family.flag_defaults):
            continue
        parser = family_parser(name)
        rows = [_row(a) for a in parser._actions if not set(a.option_strings) & general]
        lines.append(f"## {family.script or f'pretrain_{name}.py'}'s own flags\n\nEvery flag above, and these:\n\n"
                     "| flag | default | status | meaning |\n|---|---|---|---|")
        lines.extend(r for r in rows if r)
        widened = [(a, general_actions[a.option_strings[0]]) for a in parser._actions
                   if a.option_strings and a.option_strings[0] in general_actions
                   and a.choices != general_actions[a.option_strings[0]].choices]
        for action, before in widened:
            more = ", ".join(str(c) for c in action.choices if c not in before.choices)
            lines.append(f"\n`{action.option_strings[0]}` also takes {more} here.")
        if family.flag_defaults:
            changed = ", ".join(f"`--{k.replace('_', '-')}` {v}" for k, v in sorted(family.flag_defaults.items()))
            lines.append(f"\nDefaults that differ from pretrain_gpt.py's (as in Megatron's script): {changed}.")
        lines.append("")
    return lines


def render() -> str:
    parser = build_parser()
    lines = [HEADER]
    for group in parser._action_groups:
        rows = [r for r in map(_row, group._group_actions) if r]
        if rows:
            lines.append(f"## {group.title}\n\n| flag | default | status | meaning |\n|---|---|---|---|")
            lines.extend(rows)
            lines.append("")
    lines.extend(_family_sections())
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
