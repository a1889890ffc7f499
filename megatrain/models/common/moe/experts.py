"""The routed experts of a mixture-of-experts layer: ``E`` MLPs (SwiGLU or GELU, as the dense
:class:`~megatrain.models.common.mlp.MLP`) whose weights are stacked 3-D tensors, run on rows already
grouped by expert.

Parameters (a contract with initialisation, checkpoints, conversion and expert parallelism)::

    linear_fc1.weight  [E, 2F, h] SwiGLU (row 2i gate i, row 2i + 1 up i, as the dense MLP) / [E, F, h] GELU
    linear_fc1.bias    [E, 2F] / [E, F]      (only with add_bias_linear)
    linear_fc2.weight  [E, h, F]
    linear_fc2.bias    [E, h]                (only with add_bias_linear)

``linear_fc1`` / ``linear_fc2`` are :class:`GroupedLinear` modules (not ``nn.Linear``, so fp8
conversion and gradient-accumulation fusion leave them alone). Under expert parallelism the weights
are DTensors sharded on dim 0; the forward reads the local experts (``to_local()``) and takes their
number from the tensor.

Two ways to compute, with the same numbers:

* the per-expert loop (the reference; on CPU, or when the grouped kernel does not apply): one
  ``F.linear`` per expert on its rows; it reads the row counts on the host;
* ``--moe-grouped-gemm`` on CUDA: one ``torch._grouped_mm`` per projection over all local experts,
  offsets = cumulative row counts (int32, on the device, no host sync), in the autocast dtype. Used
  when torch has it, the compute dtype is bfloat16 and the widths are multiples of 8 (16-byte rows);
  otherwise the loop runs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GroupedLinear", "GroupedExperts", "grouped_linear", "local_tensor"]


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """The local part of a DTensor parameter (expert parallel), the tensor itself otherwise."""
    if t is None:
        return None
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class GroupedLinear(nn.Module):
    """``num_experts`` linear maps ``in_features -> out_features`` stored as one [E, out, in] weight
    (and an [E, out] bias). It holds the parameters; :class:`GroupedExperts` computes with them."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features)) if bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A placeholder start (a family's ``initial_value`` replaces it): N(0, 1/sqrt(in)), zero bias."""
        if self.weight.is_meta:
            return
        self.weight.normal_(0.0, 1.0 / math.sqrt(self.in_features))
        if self.bias is not None:
            self.bias.zero_()

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` [N, in] grouped by expert (``tokens_per_expert`` [E], summing to N) times their
    expert's ``weight`` [E, out, in]^T (+ ``bias`` [E, out]) with one ``torch._grouped_mm``, in
    ``x``'s dtype (the weights are cast to it)."""
    offs = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    w = weight.to(x.dtype)
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if bias is not None:
        y = y + bias.to(y.dtype).repeat_interleave(tokens_per_expert, dim=0, output_size=x.shape[0])
    return y


class GroupedExperts(nn.Module):
    """The routed experts: ``forward(x [N, h], tokens_per_expert [E_local]) -> [N, h]``, rows of
    ``x`` grouped by local expert in order (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        num_experts, hidden, ffn = config.num_moe_experts, config.hidden_size, config.moe_ffn
        self.swiglu = bool(config.swiglu)
        self.gelu_approximation = config.gelu_approximation
        self.moe_grouped_gemm = bool(config.moe_grouped_gemm)
        # None: the grouped kernel where it applies (--moe-grouped-gemm on CUDA); True / False force a
        # path (tests compare them; True still needs torch._grouped_mm).
        self.use_grouped_mm: bool | None = None
        self.linear_fc1 = GroupedLinear(num_experts, hidden, 2 * ffn if self.swiglu else ffn, config.add_bias_linear)
        self.linear_fc2 = GroupedLinear(num_experts, ffn, hidden, config.add_bias_linear)

    def activation(self, y: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = y.unflatten(-1, (-1, 2)).unbind(-1)  # interleaved rows: [..., F] each
            return F.silu(gate) * up
        return F.gelu(y, approximate=self.gelu_approximation)

    def _grouped_applies(self, x: torch.Tensor, compute_dtype: torch.dtype) -> bool:
        if not hasattr(torch, "_grouped_mm"):
            return False
        if self.use_grouped_mm is not None:
            return self.use_grouped_mm
        widths = (self.linear_fc1.in_features, self.linear_fc1.out_features, self.linear_fc2.in_features)
        return (self.moe_grouped_gemm and x.is_cuda and compute_dtype == torch.bfloat16
                and all(w % 8 == 0 for w in widths))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, b1 = local_tensor(self.linear_fc1.weight), local_tensor(self.linear_fc1.bias)
        w2, b2 = local_tensor(self.linear_fc2.weight), local_tensor(self.linear_fc2.bias)
        assert w1 is not None and w2 is not None
        assert tokens_per_expert.numel() == w1.shape[0], (tokens_per_expert.shape, w1.shape)
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type)
        compute_dtype = torch.get_autocast_dtype(device_type) if autocast else x.dtype
        if self._grouped_applies(x, compute_dtype):
            h = x.to(compute_dtype)
            h = self.activation(grouped_linear(h, w1, b1, tokens_per_expert))
            return grouped_linear(h, w2, b2, tokens_per_expert)
        return self._loop(x, tokens_per_expert, w1, b1, w2, b2)

    def _loop(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
              w2: torch.Tensor, b2: torch.Tensor | None) -> torch.Tensor:
        """One ``F.linear`` pair per expert (autocast casts as for the dense MLP); reads the counts on
        the host."""
        counts = tokens_per_expert.tolist()
        outputs = []
        for e, rows in enumerate(x.split(counts, dim=0)):
            h = F.linear(rows, w1[e], b1[e] if b1 is not None else None)
            outputs.append(F.linear(self.activation(h), w2[e], b2[e] if b2 is not None else None))
        if not outputs:
            return x.new_zeros(0, w2.shape[1])
        return torch.cat(outputs, dim=0)
