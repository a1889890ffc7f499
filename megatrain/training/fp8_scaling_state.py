"""A run's delayed fp8 scaling state (``--fp8-recipe delayed`` on megatrain's fp8 layers, see
:mod:`megatrain.runtime.fp8_scaling`): the data-parallel agreement once per optimizer step, and the
entry in each checkpoint's meta.json that a resumed run continues from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from megatrain.runtime import fp8_scaling
from megatrain.runtime.fp8_scaling import Fp8Recipe

__all__ = ["Fp8ScalingState", "META_KEY"]

META_KEY = "fp8_scaling"  # meta.json's entry


@dataclass
class Fp8ScalingState:
    layers: list[Any]  # the fp8 layers (Fp8FusedLinear) with delayed scaling
    names: list[str]  # their module names (the checkpoint's keys)
    recipe: Fp8Recipe
    replicas: int  # data x context parallel ranks that hold the same layers
    replica_group: Callable[[], Any]  # their process group (built on first use)

    @classmethod
    def of(cls, parallelized: Any, recipe: Fp8Recipe, replicas: int,
           replica_group: Callable[[], Any]) -> "Fp8ScalingState | None":
        """The run's state, or None where no fp8 layer scales with delayed scaling."""
        fusion = parallelized.grad_fusion
        if not recipe.delayed or fusion is None or not fusion.fp8_linears:
            return None
        names = parallelized.fp8_report[0]
        assert len(names) == len(fusion.fp8_linears), "one name per fp8 layer"
        return cls(fusion.fp8_linears, list(names), recipe, replicas, replica_group)

    def after_backward(self) -> None:
        """After an optimizer step's last backward: the replicas' histories agree (one all-reduce)."""
        if self.replicas > 1:
            fp8_scaling.sync_(self.layers, self.recipe, self.replica_group())

    def checkpoint_entry(self) -> dict[str, Any]:
        return {META_KEY: fp8_scaling.state_of(self.layers, self.names, self.recipe)}

    def load(self, meta: dict[str, Any], where: str) -> list[str]:
        """Restore the state a checkpoint's meta.json holds; notes to print. ``where``: the checkpoint's
        path, for the messages."""
        saved = meta.get(META_KEY)
        if saved is None:
            return [f"note: {where} holds no fp8 scaling state (saved without delayed scaling): the fp8 layers' "
                    "scales start at 1.0"]
        try:
            return fp8_scaling.load_state_(self.layers, self.names, self.recipe, saved)
        except ValueError as e:
            raise ValueError(f"{where}: meta.json: {e}") from None
