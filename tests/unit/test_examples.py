"""The example launch scripts are valid shell and every flag they pass to the training script exists
(pretrain_gpt.py's parser, or pretrain_bert.py's / pretrain_t5.py's with the family's flags)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from megatrain.training.main import family_parser

ROOT = Path(__file__).resolve().parents[2] / "examples"
EXAMPLES = sorted(p for p in ROOT.rglob("*.s*") if p.suffix in (".sh", ".sbatch"))
SCRIPTS = {"pretrain_bert.py": "bert", "pretrain_t5.py": "t5", "pretrain_gpt.py": "gpt"}


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_script_is_valid_shell_with_known_flags(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text(encoding="utf-8")
    entry = next(name for name in SCRIPTS if name in text)
    if "DISTRIBUTED_ARGS=(" in text or 'DISTRIBUTED_ARGS="' in text:  # Megatron's: flags in variables first
        command = re.sub(r'DISTRIBUTED_ARGS=(\(.*?\)|".*?")', "", text, flags=re.S)
        command = "\n".join(line for line in command.splitlines() if not line.lstrip().startswith("#"))
    else:
        command = text[text.index(entry):]
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", command))
    known = {opt for action in family_parser(SCRIPTS[entry])._actions for opt in action.option_strings}
    assert flags and not (flags - known), f"{script.name}: unknown flags {sorted(flags - known)}"
