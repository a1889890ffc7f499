"""Every tool and root script runs from a clone without ``pip install``: each puts the repository
root on ``sys.path`` itself (``--help`` from another directory, with no PYTHONPATH to the clone).

The test's interpreter has megatrain installed in editable mode (a ``.pth`` file in site-packages);
``python -S`` skips ``site``, so no ``.pth`` file is read, and PYTHONPATH names only the
site-packages directory, for torch and the other dependencies."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for p in [*ROOT.glob("tools/*.py"), *ROOT.glob("*.py")]
                 if p.name not in ("setup.py", "conftest.py"))


def _clean_env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": sysconfig.get_paths()["purelib"], "HOME": "/tmp"}


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=_clean_env(), capture_output=True,
                          text=True, timeout=180)


def test_the_clean_environment_cannot_import_megatrain(tmp_path):
    proc = _run(["-c", "import torch, megatrain"], tmp_path)
    assert "No module named 'megatrain'" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_runs_from_a_clone(tmp_path, script):
    proc = _run([str(ROOT / script), "--help"], tmp_path)
    assert proc.returncode == 0, f"{script}: {proc.stderr[-2000:]}"
    assert "usage:" in proc.stdout.lower()
