"""The engine's decode compilation: one-row ``addmm`` as a reduction (the batch-1 GEMV with a bias),
the backend that installs it, and which arguments ``torch.compile`` gets where."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatrain.inference.engine import decode_compile
from megatrain.inference.engine.decode_compile import addmm_one_row, decode_compile_kwargs, gemv_backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_addmm_is_the_matmul(dtype):
    torch.manual_seed(0)
    bias, x, w_t = torch.randn(48, dtype=dtype), torch.randn(1, 40, dtype=dtype), torch.randn(40, 48, dtype=dtype)
    out = addmm_one_row(bias, x, w_t, beta=0.5, alpha=2.0)
    expected = (0.5 * bias.double() + 2.0 * (x.double() @ w_t.double())).to(dtype)
    assert out.dtype == dtype and out.shape == (1, 48)
    torch.testing.assert_close(out, expected, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    assert addmm_one_row(bias, torch.randn(2, 40, dtype=dtype), w_t) is NotImplemented  # more rows: a matmul


def test_backend_computes_what_eager_computes_and_rewrites_the_one_row_addmm(monkeypatch):
    torch.manual_seed(0)
    rewritten = []

    def recording(bias, mat1, *args, **kwargs):
        out = addmm_one_row(bias, mat1, *args, **kwargs)
        rewritten.append((tuple(mat1.shape), out is not NotImplemented))
        return out

    monkeypatch.setattr(decode_compile, "addmm_one_row", recording)
    layer = torch.nn.Linear(32, 24)
    calls = []
    backend = gemv_backend(device_types=("cpu",))  # the CPU too, so that the rewrite runs here

    def counting(graph, inputs):
        calls.append(graph)
        return backend(graph, inputs)

    compiled = torch.compile(lambda x: F.gelu(layer(x)), backend=counting, dynamic=False)
    for rows in (1, 3):  # batch 1 through the reduction, batch 3 through the matmul
        x = torch.randn(rows, 1, 32)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), F.gelu(layer(x)), rtol=1e-5, atol=1e-6)
    assert len(calls) == 2
    assert rewritten == [((1, 32), True), ((3, 32), False)]


def test_decode_compile_arguments():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert set(decode_compile_kwargs(cuda, None, True)) == {"backend"}
    assert decode_compile_kwargs(cuda, None, False) == {}
    assert decode_compile_kwargs(cpu, None, True) == {}  # no GEMV reductions for the CPU
    assert decode_compile_kwargs(cuda, "max-autotune-no-cudagraphs", True) == {"mode": "max-autotune-no-cudagraphs"}
