"""Turning user mistakes into one clear line instead of a traceback."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def user_errors_exit(fn: F) -> F:
    """Run a command's ``main``: a ValueError/FileNotFoundError (a user mistake) prints
    ``error: ...`` and exits with status 2; set MEGATRAIN_DEBUG=1 to see the traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ValueError, FileNotFoundError) as e:
            if os.environ.get("MEGATRAIN_DEBUG"):
                raise
            print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    return wrapper  # type: ignore[return-value]
