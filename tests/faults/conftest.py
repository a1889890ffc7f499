"""Shared parts of the fault-injection suite (tests/faults/): real runs, real files, real signals.

Fixtures (all named ``fault_*`` so that the suite's test files can keep their own local helpers):

``fault_checkpoint`` (session)
    A tiny checkpoint trained once per session by a real ``pretrain_gpt.py`` run
    (:data:`FAULT_TRAIN_ARGS`, mock data, NullTokenizer, 4 iterations, saved at 2 and 4): a
    :class:`FaultCheckpoint` with the ``--save`` directory, the newest iteration and its directory,
    the training flags and the run's stdout. Never modify it: take ``fault_checkpoint_copy``.
``fault_checkpoint_copy`` (function)
    A private copy of ``fault_checkpoint`` under the test's ``tmp_path``, free to corrupt.
``fault_fails_cleanly`` (function)
    :func:`fault_fails_cleanly`: run a command (or take a finished one) and assert that it failed
    with exactly one clear ``error: ...`` line on stderr and no traceback; returns that line.
``fault_small_tmpfs`` (function)
    :func:`small_tmpfs`: a context manager giving a real tmpfs of a few KB/MB for disk-full
    (ENOSPC) tests, mounted in a user + mount namespace (no root needed); skips the test where
    the kernel or the container does not allow it.

The module-level functions are importable too (``from tests.faults.conftest import ...``), as are
:func:`fault_train_cmd` (a ``pretrain_gpt.py`` command line for the tiny model) and
:func:`fault_losses` (iteration -> logged ``lm loss`` of a run's output).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from tests.e2e.conftest import REPO, cpu_env, run_cmd

# A model small enough that a run's time is Python's start-up: 135k parameters, one CPU thread.
# Dropout is on, so that a resumed run only matches an uninterrupted one when the RNG came back too.
FAULT_TRAIN_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
                    "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--num-workers", "0", "--lr", "1e-3",
                    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--log-interval", "1",
                    "--eval-iters", "0"]


def fault_train_cmd(train_iters: int, *extra: str) -> list[str]:
    """``python pretrain_gpt.py`` with :data:`FAULT_TRAIN_ARGS`, ``--train-iters`` and ``extra`` flags."""
    return [sys.executable, "pretrain_gpt.py", *FAULT_TRAIN_ARGS, "--train-iters", str(train_iters), *extra]


def fault_losses(stdout: str) -> dict[int, float]:
    """Iteration -> ``lm loss`` of every training log line in a run's output (guide §3.3)."""
    from megatrain.training.logging import parse_train_log_line

    out = {}
    for line in stdout.splitlines():
        if "] iteration " in line:
            d = parse_train_log_line(line)
            out[d["iteration"]] = d["lm loss"]
    return out


# ------------------------------------------------------------------------------------- a tiny checkpoint

@dataclass(frozen=True)
class FaultCheckpoint:
    save: str  # the --save directory: iter_0000002/, iter_0000004/, latest_checkpointed_iteration.txt
    iteration: int  # the newest iteration (the tracker's)
    ckpt: str  # its iter_XXXXXXX directory
    train_args: tuple[str, ...]  # the flags it was trained with (without --save / --train-iters)
    stdout: str  # the training run's output


@pytest.fixture(scope="session")
def fault_checkpoint(tmp_path_factory) -> FaultCheckpoint:
    from megatrain.checkpoint import checkpoint_dir

    save = tmp_path_factory.mktemp("fault_checkpoint") / "ckpt"
    proc = run_cmd(fault_train_cmd(4, "--save", str(save), "--save-interval", "2"), env=cpu_env())
    iteration = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert iteration == 4, proc.stdout
    return FaultCheckpoint(str(save), iteration, checkpoint_dir(str(save), iteration), tuple(FAULT_TRAIN_ARGS),
                           proc.stdout)


@pytest.fixture
def fault_checkpoint_copy(fault_checkpoint: FaultCheckpoint, tmp_path: Path) -> FaultCheckpoint:
    from megatrain.checkpoint import checkpoint_dir

    save = tmp_path / "ckpt"
    shutil.copytree(fault_checkpoint.save, save)
    return replace(fault_checkpoint, save=str(save), ckpt=checkpoint_dir(str(save), fault_checkpoint.iteration))


# ------------------------------------------------------------------------------- one clear line, no trace

ERROR_LINE = re.compile(r"^(\S+: )?error: \S")  # megatrain's `error: ...` (argparse: `prog: error: ...`)


def fault_fails_cleanly(cmd: Sequence[str] | subprocess.CompletedProcess, *, timeout: int = 120,
                        env: dict | None = None, only_line: bool = True) -> str:
    """Assert that ``cmd`` (an argv run from the repository root, or a finished process) failed
    with one clear line on stderr: a non-zero status, no ``Traceback``, and a last non-empty
    stderr line ``error: ...``; with ``only_line`` (the default) that line is all stderr holds.
    Returns the line."""
    if isinstance(cmd, subprocess.CompletedProcess):
        proc = cmd
    else:
        proc = subprocess.run(list(cmd), cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env=env if env is not None else cpu_env())
    stderr = proc.stderr if isinstance(proc.stderr, str) else (proc.stderr or b"").decode("utf-8", "replace")
    shown = f"--- status {proc.returncode}\n--- stderr\n{stderr[-3000:]}"
    assert proc.returncode not in (0, None), f"the command succeeded, a failure was expected\n{shown}"
    assert "Traceback" not in stderr, f"a traceback instead of one line\n{shown}"
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert lines, f"the command failed without saying why\n{shown}"
    assert ERROR_LINE.match(lines[-1]), f"the last line on stderr is not an `error: ...` line\n{shown}"
    if only_line:
        assert len(lines) == 1, f"more than one line on stderr\n{shown}"
    return lines[-1]


@pytest.fixture(name="fault_fails_cleanly")
def _fault_fails_cleanly_fixture():
    """The function :func:`fault_fails_cleanly` (importable under the same name)."""
    return fault_fails_cleanly


# ------------------------------------------------------------------------------------ a small real tmpfs

class SmallTmpfs:
    """A mount point whose tmpfs of ``size`` exists only for the commands run through it: each one
    runs in a new user + mount namespace that mounts the tmpfs on ``dir`` first. What a command
    writes there vanishes when it exits; use the command's own output (or a second command in the
    same :meth:`wrap`, e.g. ``sh -c``) to look at the files."""

    def __init__(self, directory: str, size: str):
        self.dir = directory
        self.size = size

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` to run under the tmpfs (a program and its arguments, not a shell string)."""
        script = 'mount -t tmpfs -o size="$1" tmpfs "$2" || exit 97; shift 2; exec "$@"'
        return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", self.size, self.dir,
                *argv]

    def run(self, argv: Sequence[str], *, timeout: int = 120, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` from the repository root under the tmpfs; the finished process (not checked)."""
        proc = subprocess.run(self.wrap(argv), cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env=env if env is not None else cpu_env())
        assert proc.returncode != 97, f"mounting the tmpfs failed: {proc.stderr}"
        return proc


def _size_text(size: int | str) -> str:
    return str(size) if isinstance(size, int) else size.strip()


@contextlib.contextmanager
def small_tmpfs(size: int | str, parent: str | os.PathLike | None = None) -> Iterator[SmallTmpfs]:
    """A :class:`SmallTmpfs` of ``size`` (bytes, or mount's ``64k`` / ``2m`` forms) on a fresh
    directory under ``parent`` (default: the system's temporary directory), removed afterwards.

    Skips the test when unshare or the mount is not permitted here (no user namespaces, seccomp)."""
    if shutil.which("unshare") is None:
        pytest.skip("small_tmpfs: no `unshare` command")
    directory = tempfile.mkdtemp(prefix="fault_tmpfs_", dir=parent)
    try:
        fs = SmallTmpfs(directory, _size_text(size))
        probe = subprocess.run(fs.wrap(["sh", "-c", 'test "$(stat -f -c %T "$0")" = tmpfs', directory]),
                               capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            pytest.skip(f"small_tmpfs: a tmpfs cannot be mounted in a user namespace here "
                        f"({(probe.stderr.strip().splitlines() or ['status %d' % probe.returncode])[-1]})")
        yield fs
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(name="fault_small_tmpfs")
def _fault_small_tmpfs_fixture():
    """The context manager :func:`small_tmpfs`."""
    return small_tmpfs
