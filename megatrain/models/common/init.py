"""Layout-independent initialisation: every parameter's initial value is a pure function of
(seed, canonical parameter name, shape), so a model built on the meta device and sharded afterwards
starts from exactly the same weights as one built whole on one device.

A family states its rules as module names (which weights get ``N(0, std)``, which write into the
residual stream and get ``N(0, std / sqrt(2 L))``) and calls :func:`megatron_initial_value`.

Values are drawn on the CPU (mt19937), or, inside :func:`drawing_on` a CUDA device, by that device's
generator (Philox), which is what training on a GPU does by default: no host drawing and no copy of the
whole model to the GPU at start-up (``--use-cpu-initialization`` keeps the CPU's values). Both are
layout-independent; the two devices' values differ.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager

import torch

from megatrain.models.common.config import TransformerConfig

__all__ = ["canonical_parameter_name", "drawing_on", "seeded_normal", "megatron_initial_value",
           "RESIDUAL_PROJECTIONS"]

# Path parts that wrappers insert (torch.compile, activation checkpointing, DDP/FSDP1); dropping
# them gives every parameter the same canonical name whatever wraps it.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module"})

RESIDUAL_PROJECTIONS = frozenset({"linear_proj", "linear_fc2"})  # the layer's writes into the residual stream


def canonical_parameter_name(name: str) -> str:
    """``name`` without the path parts that wrappers add."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


# Where initial values are drawn (set by drawing_on; read by the drawing threads of init_parameters).
_DRAW_DEVICE = [torch.device("cpu")]


@contextmanager
def drawing_on(device: torch.device | str) -> Iterator[None]:
    """Draw the initial values (:func:`seeded_normal`, and the constant ones) on ``device`` inside the block."""
    before = _DRAW_DEVICE[0]
    _DRAW_DEVICE[0] = torch.device(device)
    try:
        yield
    finally:
        _DRAW_DEVICE[0] = before


def seeded_normal(canonical: str, shape: Sequence[int], std: float, seed: int) -> torch.Tensor:
    """``N(0, std)`` float32 values from a generator seeded by (seed, crc32 of the name), on the CPU or on
    the device of :func:`drawing_on`."""
    # The CPU generator (mt19937) keeps only 32 bits of its seed, so hash seed and name together.
    device = _DRAW_DEVICE[0]
    generator = torch.Generator(device=device)
    generator.manual_seed(zlib.crc32(f"{seed}:{canonical}".encode("utf-8")))
    return torch.empty(tuple(shape), device=device).normal_(mean=0.0, std=std, generator=generator)


# Norms not named ``*layernorm``: multi-token prediction's embedding and hidden-state norms (Megatron's names).
_OTHER_NORMS = frozenset({"enorm", "hnorm"})


def megatron_initial_value(name: str, shape: Sequence[int], config: TransformerConfig, seed: int, *,
                           std_weights: Collection[str],
                           scaled_weights: Collection[str] = RESIDUAL_PROJECTIONS) -> torch.Tensor:
    """The initial value of parameter ``name`` as a float32 tensor of ``shape`` (on the CPU, or on the
    device of :func:`drawing_on`).

    Megatron's scheme: weights of the modules in ``std_weights`` ~ N(0, std); those in
    ``scaled_weights`` (the projections that add into the residual stream) ~ N(0, std / sqrt(2 L));
    a parameter whose own name (not ``weight``) is in ``std_weights`` ~ N(0, std);
    biases 0; norm weights (modules whose name ends in ``layernorm``, and ``enorm``/``hnorm``) 1, or 0 with
    ``--apply-layernorm-1p``, and their biases 0. Any other parameter is refused (ValueError), so
    a new module cannot silently start from garbage.
    """
    canonical = canonical_parameter_name(name)
    parts = canonical.split(".")
    if len(parts) < 2:
        raise ValueError(f"no initialisation rule for parameter {name!r}")
    module, leaf = parts[-2], parts[-1]
    shape = tuple(shape)

    if module.endswith("layernorm") or module in _OTHER_NORMS:
        if leaf == "weight" and not config.apply_layernorm_1p:  # 1p: the zero weight means a scale of 1
            return torch.ones(shape, device=_DRAW_DEVICE[0])
        return torch.zeros(shape, device=_DRAW_DEVICE[0])
    if leaf == "bias":
        return torch.zeros(shape, device=_DRAW_DEVICE[0])
    if leaf != "weight":
        if leaf in std_weights:  # a parameter named for itself (a MoE layer's shared_experts.gate_weight)
            return seeded_normal(canonical, shape, config.init_method_std, seed)
        raise ValueError(f"no initialisation rule for parameter {name!r}")
    if module in std_weights:
        std = config.init_method_std
    elif module in scaled_weights:
        std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
    else:
        raise ValueError(f"no initialisation rule for parameter {name!r}")
    return seeded_normal(canonical, shape, std, seed)
