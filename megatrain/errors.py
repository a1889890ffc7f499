"""Turning user mistakes into one clear line instead of a traceback."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def underlying(error: BaseException | None, match: Callable[[BaseException], bool]) -> BaseException | None:
    """The first exception ``match`` accepts among ``error``, the failures a library collected in it
    (DCP raises a CheckpointException whose ``failures`` maps each rank to its exception, or to an
    (exception, traceback) pair), and its cause and context, searched depth first."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if match(e):
            return e
        failures = getattr(e, "failures", None)
        found = list(failures.values()) if isinstance(failures, dict) else []
        inner = [f[0] if isinstance(f, tuple) and f else f for f in found]
        # pushed in reverse so that the failures come first, in order, then the cause, then the context
        stack.extend(reversed([x for x in inner if isinstance(x, BaseException)] + [e.__cause__, e.__context__]))
    return None


def is_interrupt(e: BaseException | None) -> bool:
    """A KeyboardInterrupt, also when a library re-raised it wrapped in its own exception."""
    return underlying(e, lambda x: isinstance(x, KeyboardInterrupt)) is not None


def loader_worker_message(text: str) -> str:
    """The original message of an error raised in a DataLoader worker (torch re-raises it in the main
    process with "Caught X in DataLoader worker process N." and the worker's traceback as its message:
    the last line is ``X: message``); other messages unchanged."""
    if not (text.startswith("Caught ") and "Original Traceback" in text):
        return text
    last = text.rstrip().splitlines()[-1]
    _, sep, message = last.partition(": ")
    return message if sep else last


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
            print(f"error: {loader_worker_message(str(e))}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        except BaseException as e:  # noqa: BLE001 - only interrupts are turned into a line; the rest re-raise
            if isinstance(e, SystemExit) or not is_interrupt(e) or os.environ.get("MEGATRAIN_DEBUG"):
                raise
            print("error: interrupted (Ctrl-C / SIGINT); complete files and checkpoints are kept, work in "
                  "progress was only under temporary names", file=sys.stderr, flush=True)
            raise SystemExit(130) from None

    return wrapper  # type: ignore[return-value]
