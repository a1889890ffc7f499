"""Where a model keeps its transformer layers: the one place generic code (recomputation, per-layer
compilation, FSDP2 units, gradient-accumulation fusion, context parallelism) finds them.

A model has a ``layers`` ModuleDict keyed by layer number (a decoder-only model, an encoder), or
several stacks: an encoder-decoder defines ``layer_stacks()`` returning its ModuleDicts by module
path, in the order its forward runs them (``{"encoder.layers": ..., "decoder.layers": ...}``).
"""

from __future__ import annotations

from torch import nn

__all__ = ["layer_stacks", "transformer_layers"]


def layer_stacks(model: nn.Module) -> dict[str, nn.ModuleDict]:
    """The model's stacks of transformer layers by module path, in forward order."""
    stacks = getattr(model, "layer_stacks", None)
    if callable(stacks):
        return dict(stacks())
    return {"layers": model.layers}


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """Every transformer layer of the model, in forward order: its stacks', then those a model runs
    after them outside a stack (``extra_transformer_layers()``: GPT's multi-token prediction depths)."""
    layers = [layer for stack in layer_stacks(model).values() for layer in stack.values()]
    extra = getattr(model, "extra_transformer_layers", None)
    return layers + (list(extra()) if callable(extra) else [])
