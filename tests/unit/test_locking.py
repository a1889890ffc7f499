"""The output lock: a live holder refuses a second run by name; a dead holder's lock is taken over."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from megatrain.locking import LockHeld, acquire, exclusive_lock

HOLD = """
import sys, time
from megatrain.locking import acquire
lock = acquire(sys.argv[1], "--save test")
print("held", flush=True)
time.sleep(60)
"""


def _holder(path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_holder_is_refused_with_the_first_ones_pid(tmp_path):
    path = tmp_path / "x.lock"
    proc = _holder(path)
    try:
        with pytest.raises(LockHeld, match=rf"--save test is in use by pid {proc.pid} on host"):
            acquire(path, "--save test")
    finally:
        proc.kill()
        proc.wait()


def test_lock_of_a_killed_process_is_taken_over(tmp_path):
    path = tmp_path / "x.lock"
    proc = _holder(path)
    proc.kill()
    proc.wait()
    assert path.exists()  # kill -9 leaves the file behind
    lock = acquire(path, "--save test")
    assert lock.stale_holder is not None and lock.stale_holder["pid"] == proc.pid
    lock.release()
    assert not path.exists()


def test_release_removes_the_file_and_the_lock_can_be_taken_again(tmp_path):
    path = tmp_path / "x.lock"
    with exclusive_lock(path, "what") as lock:
        assert lock.stale_holder is None
        assert path.exists()
        with pytest.raises(LockHeld):
            acquire(path, "what")  # a second open file description in the same process is refused too
    assert not path.exists()
    with exclusive_lock(path, "what"):
        pass


def test_unwritable_directory_is_one_clear_error(tmp_path):
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(OSError, match="cannot create the lock file"):
        acquire(target / "x.lock", "--save x")


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    path = tmp_path / "x.lock"
    lock = acquire(path, "what")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child (its fork hooks have run by now): says so, then sleeps
        os.write(w, b"x")
        time.sleep(30)
        os._exit(0)
    try:
        assert os.read(r, 1) == b"x"
        os.close(lock.fd)  # as if the parent died: only the child's copy could hold the flock now
        lock.fd = -1
        again = acquire(path, "what")
        again.release()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
