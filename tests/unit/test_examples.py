"""The example launch scripts are valid shell and every flag they pass to pretrain_gpt.py exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from megatrain.training.arguments import build_parser

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.s*"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_script_is_valid_shell_with_known_flags(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text(encoding="utf-8")
    command = text[text.index("pretrain_gpt.py"):]
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", command))
    known = {opt for action in build_parser()._actions for opt in action.option_strings}
    assert flags and not (flags - known), f"{script.name}: unknown flags {sorted(flags - known)}"
