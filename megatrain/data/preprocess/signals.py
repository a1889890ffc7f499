"""How signals end a preprocessing run. In the main process SIGINT and SIGTERM raise `_Interrupted`,
so the run's clean-up (``driver``) removes what it created and the command exits 130 or 143; a
worker ignores Ctrl-C (the parent acts on it), ends at once on SIGTERM, and is killed by the kernel
when its parent ends, however it ends (``PR_SET_PDEATHSIG``), so a ``kill -9`` leaves no workers."""

from __future__ import annotations

import contextlib
import os
import signal


class _Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the main process (``signum`` says which)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_interrupt():
    """In the main process, SIGTERM and SIGINT raise `_Interrupted` (once: a second signal
    during the clean-up that follows is ignored); forked children get the default actions."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    main_pid = os.getpid()

    def handler(signum, frame):
        if os.getpid() != main_pid:  # a child forked before it reset its handlers
            if signum == signal.SIGTERM:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _Interrupted(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _worker_signals(parent_pid: int) -> None:
    """The signal actions of a pool worker (run first in each worker)."""
    # Ctrl-C reaches the whole process group: only the parent acts on it. SIGTERM (sent by
    # the parent's pool on shutdown) ends a worker at once and quietly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent_pid)


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to kill this process when its parent ends (Linux), however it ends."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent was already gone before the request
        os._exit(1)
