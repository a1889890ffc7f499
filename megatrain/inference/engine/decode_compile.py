"""How the engine compiles its decode forward: ``torch.compile``'s arguments, and on CUDA the
tuned batch-1 matrix-vector products.

At batch 1 every linear layer of a decode step multiplies one row by its weight: the step reads
every weight once and does almost no arithmetic, so its speed is the rate at which the weights are
read. cuBLAS runs such products with tall-skinny GEMM tiles that read the smaller projections of a
1-2B model at a third to a half of the copy rate. Inductor instead writes a one-row ``mm`` as a
reduction over the weight (``(x[:, :, None] * w[None]).sum(1)``) when coordinate-descent tuning is
on, and tunes that reduction's tiles for bandwidth. Its decomposition covers ``mm`` only; a linear
layer with a bias lowers to ``addmm``, which this module decomposes the same way (the bias added to
the reduction's result, in float32 as the ``mm`` decomposition computes), so GPT-2-style models with
biases get the same kernels as LLaMA-style ones. Larger batches keep their matmuls.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = ["decode_compile_kwargs", "addmm_one_row", "gemv_backend"]

_TUNING = {"coordinate_descent_tuning": True}


def addmm_one_row(bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1,
                  out_dtype: torch.dtype | None = None) -> Any:
    """``aten.addmm`` of a one-row ``mat1`` [1, k] as a reduction ``bias + mat1 @ mat2`` computed in
    float32 (at least) and returned in the operands' dtype; ``NotImplemented`` (keep the matmul) for
    more rows, or a result dtype of its own."""
    if out_dtype is not None or not statically_known_true(mat1.shape[0] == 1):
        return NotImplemented
    dtype = torch.promote_types(mat1.dtype, torch.float32)
    product = (mat1.to(dtype).unsqueeze(2) * mat2.to(dtype).unsqueeze(0)).sum(dim=1)
    return (beta * bias.to(dtype) + alpha * product).to(mat1.dtype)


def gemv_backend(device_types: tuple[str, ...] = ("cuda",)) -> Callable:
    """A ``torch.compile`` backend: Inductor with coordinate-descent tuning and one-row ``addmm`` as a
    reduction on ``device_types`` (the ``mm`` decomposition of Inductor's own table does the rest)."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    def addmm(bias, mat1, mat2, *args, **kwargs):
        if mat1.device.type not in device_types:
            return NotImplemented
        return addmm_one_row(bias, mat1, mat2, *args, **kwargs)

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> Any:
        table = dict(select_decomp_table())
        table[torch.ops.aten.addmm.default] = _chain(addmm, table.get(torch.ops.aten.addmm.default))
        return compile_fx(graph, example_inputs, config_patches=dict(_TUNING), decompositions=table)

    return backend


def _chain(first: Callable, then: Callable | None) -> Callable:
    """A decomposition that tries ``first`` and, where it declines, Inductor's own (if any)."""
    def decomposition(*args, **kwargs):
        out = first(*args, **kwargs)
        if out is NotImplemented and then is not None:
            return then(*args, **kwargs)
        return out
    return decomposition


def decode_compile_kwargs(device: torch.device, mode: str | None, gemv_tuning: bool) -> dict:
    """``torch.compile``'s arguments for the decode forward: a named ``mode``; or on CUDA with
    ``gemv_tuning`` the backend of this module; or nothing (Inductor's defaults)."""
    if mode is not None:
        return {"mode": mode}
    if gemv_tuning and device.type == "cuda":
        return {"backend": gemv_backend()}
    return {}
