"""The `megatrain` command: every subcommand starts and shows its help; unknown ones are refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatrain.cli import COMMANDS


@pytest.mark.parametrize("name", sorted(set(COMMANDS) - {"demo"}))
def test_subcommand_help(name, capsys):
    from megatrain.cli import main

    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_unknown_subcommand_suggests():
    proc = subprocess.run([sys.executable, "-m", "megatrain", "pretrian"], capture_output=True, text=True)
    assert proc.returncode != 0 and "did you mean pretrain" in proc.stderr
