"""The fault suite's shared helpers (tests/faults/conftest.py) do what the other fault tests rely on:
the tmpfs really fills up, the one-line check accepts one ``error:`` line and refuses a traceback
or a second line, and the session checkpoint is a complete one."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from megatrain import checkpoint as checkpointing


def test_small_tmpfs_fills_up_with_enospc(fault_small_tmpfs):
    with fault_small_tmpfs("64k") as fs:
        write = (f"import os\nwith open(os.path.join({fs.dir!r}, 'big'), 'wb') as f:\n"
                 f"    try:\n        f.write(b'x' * 200_000); f.flush()\n"
                 f"    except OSError as e:\n        print(e.errno)\n")
        proc = fs.run([sys.executable, "-c", write])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == str(errno.ENOSPC)
        assert os.listdir(fs.dir) == []  # the tmpfs lived in the command's namespace only
    assert not os.path.exists(fs.dir)


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_fails_cleanly_accepts_one_error_line(fault_fails_cleanly):
    line = fault_fails_cleanly(_py("raise SystemExit('error: --lr: must be positive')"))
    assert line == "error: --lr: must be positive"
    warned = _py("import sys; print('WARNING: x', file=sys.stderr); sys.exit('error: --lr: bad')")
    assert fault_fails_cleanly(warned, only_line=False) == "error: --lr: bad"


@pytest.mark.parametrize("code", [
    "raise ValueError('error: looks like one line')",  # a traceback
    "import sys; print('WARNING: x', file=sys.stderr); sys.exit('error: --lr: bad')",  # two lines
    "raise SystemExit(3)",  # says nothing
    "raise SystemExit('no space left')",  # not an error: line
    "print('error: but the status is 0')",  # succeeded
])
def test_fails_cleanly_refuses_anything_else(fault_fails_cleanly, code):
    with pytest.raises(AssertionError):
        fault_fails_cleanly(_py(code))


def test_fails_cleanly_takes_a_finished_process(fault_fails_cleanly):
    proc = subprocess.run(_py("raise SystemExit('error: x.idx: truncated')"), capture_output=True, text=True)
    assert fault_fails_cleanly(proc) == "error: x.idx: truncated"


def test_the_session_checkpoint_is_complete_and_the_copy_is_private(fault_checkpoint, fault_checkpoint_copy):
    assert fault_checkpoint.iteration == 4
    assert checkpointing.find_checkpoint(fault_checkpoint.save) == fault_checkpoint.ckpt
    assert checkpointing.checkpoint_problem(fault_checkpoint_copy.ckpt) is None
    assert fault_checkpoint_copy.save != fault_checkpoint.save
    assert sorted(os.listdir(fault_checkpoint_copy.save)) == sorted(os.listdir(fault_checkpoint.save))


def test_small_tmpfs_skips_where_unshare_is_missing(fault_small_tmpfs, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without `unshare`
    with pytest.raises(pytest.skip.Exception, match="unshare"):
        with fault_small_tmpfs("64k"):
            pass
