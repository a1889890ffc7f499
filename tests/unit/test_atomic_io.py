"""Atomic writes: the final name holds the old file or the complete new one, never a part."""

from __future__ import annotations

import json
import os
import stat

import pytest

from megatrain.atomic_io import atomic_path, atomic_write_json, atomic_write_text


def test_success_replaces_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    atomic_write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    atomic_write_text(target, "new", fsync=True)
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failure_keeps_the_old_file_and_removes_the_temporary(tmp_path, error):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(error):
        with atomic_path(target) as tmp, open(tmp, "wb") as f:
            f.write(b"half")
            raise error()
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


def test_written_files_get_the_mode_of_a_plain_open(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic_write_text(tmp_path / "atomic.txt", "x")
    assert stat.S_IMODE(os.stat(tmp_path / "atomic.txt").st_mode) == stat.S_IMODE(os.stat(plain).st_mode)
