"""`compiler_disable`: ``@torch.compiler.disable`` without importing ``torch._dynamo`` when decorating.

``torch.compiler.disable`` imports ``torch._dynamo`` (about 0.7 s of every process's start-up) as it
decorates. `compiler_disable` leaves the import to the first call made while something may compile,
and keeps the decorator's behaviour:

* a compiled caller breaks its graph at the call: dynamo never inlines a function marked
  ``_torchdynamo_disable``, as it never inlines ``torch.compiler.disable``'s wrapper;
* the call itself runs eagerly: the wrapper's frame, and every frame under it, is marked for dynamo to
  skip (what ``torch._dynamo``'s ``skip_code`` does, here without importing it), and inside it
  ``torch.compiler.disable(fn)``, made once, runs ``fn`` with compilation off;
* while ``torch._dynamo`` is not imported nothing can be compiling (``torch.compile`` and
  ``torch.export`` import it), so ``fn`` is simply called.

Where torch lacks the frame-skipping hook, `compiler_disable` is ``torch.compiler.disable``.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

import torch

__all__ = ["compiler_disable"]

_F = TypeVar("_F", bound=Callable[..., Any])

try:
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    _SKIP = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)  # this frame and every frame under it
except (ImportError, AttributeError):  # an older torch: decorate at once
    _SKIP = None


def compiler_disable(fn: _F) -> _F:
    """``torch.compiler.disable(fn)``, with ``torch._dynamo`` imported only when a call needs it."""
    if _SKIP is None:
        return torch.compiler.disable(fn)
    disabled = None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    wrapper._torchdynamo_disable = True  # type: ignore[attr-defined]
    set_code_exec_strategy(wrapper.__code__, _SKIP)
    return wrapper  # type: ignore[return-value]
