"""`megatrain.compiler_disable.compiler_disable` behaves as ``torch.compiler.disable`` under
``torch.compile`` (same graphs, graph breaks and compiled frames; the function and what it calls run
eagerly), also when its first call is made while compiling, and decorating or calling it eagerly does
not import ``torch._dynamo`` (nor does importing the trainer, nor DCP)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatrain.compiler_disable import compiler_disable

ROOT = Path(__file__).resolve().parents[2]


def _compiled_run(disable, fullgraph: bool = False) -> tuple:
    """Compiles a module calling a disabled function, method and ``__call__``; returns what dynamo
    counted and whether each disabled body (and a function it calls) saw compilation."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    seen: list[bool] = []

    def inner(x):
        seen.append(torch.compiler.is_compiling())
        return x * 3

    @disable
    def fn(x):
        seen.append(torch.compiler.is_compiling())
        return inner(x) + 1

    class Head:
        @disable
        def __call__(self, x):
            seen.append(torch.compiler.is_compiling())
            return x.exp()

    class M(torch.nn.Module):
        head = Head()

        @disable
        def meth(self, x):
            seen.append(torch.compiler.is_compiling())
            return x - 1

        def forward(self, x):
            return self.head(self.meth(fn(x.sin())).cos()).tanh()

    m, x = M(), torch.randn(4)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, backend="eager", fullgraph=fullgraph)
    for _ in range(3):
        out = compiled(x)
    torch.testing.assert_close(out, m(x))
    breaks = sum(counters["graph_break"].values())
    return counters["frames"]["total"], counters["stats"]["unique_graphs"], breaks, any(seen), len(seen)


def test_compiled_callers_see_what_torch_compiler_disable_gives():
    lazy, real = _compiled_run(compiler_disable), _compiled_run(torch.compiler.disable)
    assert lazy == real
    frames, graphs, breaks, traced, calls = lazy
    assert graphs == 3 and breaks >= 3 and not traced and calls == 4 * 4  # 3 compiled calls + 1 eager


def test_fullgraph_refuses_both_alike():
    from torch._dynamo.exc import Unsupported

    for disable in (compiler_disable, torch.compiler.disable):
        with pytest.raises(Unsupported):
            _compiled_run(disable, fullgraph=True)


def test_no_dynamo_or_dcp_at_import():
    code = textwrap.dedent("""
        import sys
        import torch
        import megatrain.training.main
        from megatrain.compiler_disable import compiler_disable

        @compiler_disable
        def f(x):
            return x + 1

        assert f.__name__ == "f" and f(torch.ones(1)).item() == 2
        loaded = [m for m in ("torch._dynamo", "torch.distributed.checkpoint") if m in sys.modules]
        assert not loaded, loaded
    """)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
