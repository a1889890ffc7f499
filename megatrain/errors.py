"""Turning user mistakes into one clear line instead of a traceback."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def is_interrupt(e: BaseException | None) -> bool:
    """A KeyboardInterrupt, also when a library re-raised it wrapped in its own exception (DCP collects
    the exceptions of a save in ``failures`` and raises a CheckpointException)."""
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, KeyboardInterrupt):
            return True
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and failures and all(
                is_interrupt(f if isinstance(f, BaseException) else getattr(f, "exception", None))
                or "KeyboardInterrupt" in repr(f) for f in failures.values()):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


def user_errors_exit(fn: F) -> F:
    """Run a command's ``main``: a ValueError/FileNotFoundError (a user mistake) prints
    ``error: ...`` and exits with status 2; Ctrl-C prints one line and exits with 130 (files in
    progress are left only under temporary names); set MEGATRAIN_DEBUG=1 to see the traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ValueError, FileNotFoundError) as e:
            if os.environ.get("MEGATRAIN_DEBUG"):
                raise
            print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        except BaseException as e:  # noqa: BLE001 - only interrupts are turned into a line; the rest re-raise
            if isinstance(e, SystemExit) or not is_interrupt(e) or os.environ.get("MEGATRAIN_DEBUG"):
                raise
            print("error: interrupted (Ctrl-C / SIGINT); complete files and checkpoints are kept, work in "
                  "progress was only under temporary names", file=sys.stderr, flush=True)
            raise SystemExit(130) from None

    return wrapper  # type: ignore[return-value]
