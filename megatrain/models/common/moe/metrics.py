"""The logged MoE values and the trainer's per-iteration MoE bookkeeping (Megatron-LM's
``moe_logging`` tracker and the MoE steps of its training loop).

Each router sums its values (``load_balancing_loss``, ``seq_load_balancing_loss``,
``global_load_balancing_loss``, ``z_loss``) over the iteration's micro-batches on the device.
:class:`MoEMetrics`, after each iteration's backward, gathers them into a ``[names, layers]`` table
(a layer's value times ``1 / micro-batches``, 0 for dense layers), adds it to the log interval's sum
and keeps it as the last iteration's; the expert biases are updated and the global_aux_loss counts
restart there too. Reading (:meth:`MoEMetrics.read`, at log time: the only host sync) reduces a
table as Megatron's tracker: within the pipeline stage over the routers' groups (the balancing losses
summed over ``reduce_group`` -- ``global_group`` for global_aux_loss --, the z-loss averaged over
``reduce_group``), then summed over the pipeline ranks (each holds its layers' values) and averaged
over the data-parallel ranks; a name's value is the sum over layers / the number of MoE layers of
the whole model (Megatron's ``_aggregate``). The process groups are passed in (None: one process);
every rank of them must read together.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatrain.models.common.config import TransformerConfig
from megatrain.models.common.moe.aux_loss import group_size
from megatrain.models.common.moe.router import (BALANCING_LOSS_NAMES, TopKRouter, moe_routers, reset_global_aux_loss,
                                                update_expert_biases)

__all__ = ["MoEMetrics", "MoEReport", "logged_names", "reduce_layer_values"]


def logged_names(config: TransformerConfig) -> tuple[str, ...]:
    """The values Megatron's training log shows for ``config``: a balancing loss per chosen type
    whose coefficient is above 0 (Megatron's router neither computes nor tracks one at 0), and
    ``z_loss`` with --moe-z-loss-coeff."""
    types = config.moe_router_load_balancing_type
    chosen = [types] if isinstance(types, str) else list(types)
    names = [name for kind, name in BALANCING_LOSS_NAMES.items()
             if kind in chosen and config.aux_loss_coeff(kind) > 0]
    if config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return tuple(names)


def _stage_reduction(name: str, router: TopKRouter) -> tuple[Any, bool]:
    """(group, average?) of ``name`` over the ranks of one pipeline stage."""
    if name == "z_loss":
        return router.reduce_group, True
    if name == BALANCING_LOSS_NAMES["global_aux_loss"]:
        return router.global_group, False
    return router.reduce_group, False


def _all_reduce(values: torch.Tensor, group: Any, average: bool) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return values
    values = values.contiguous()
    dist.all_reduce(values, group=group)  # SUM (gloo has no AVG)
    return values / size if average else values


def reduce_layer_values(values: torch.Tensor, names: tuple[str, ...], routers: list[TopKRouter], *,
                        pp_group: Any = None, dp_group: Any = None) -> torch.Tensor:
    """``values`` [..., len(names), layers] (this rank's) reduced over the ranks (see the module doc):
    the stage's groups come from ``routers`` (none on a stage without MoE layers: nothing to reduce
    there), then a sum over ``pp_group`` and an average over ``dp_group`` (None: one process)."""
    out = values.clone()
    if routers:
        specs: dict[tuple[int, bool], tuple[Any, list[int]]] = {}
        for j, name in enumerate(names):
            group, average = _stage_reduction(name, routers[0])
            specs.setdefault((id(group), average), (group, []))[1].append(j)
        for (_, average), (group, rows) in specs.items():
            if group_size(group) > 1:
                out[..., rows, :] = _all_reduce(out[..., rows, :], group, average)
    out = _all_reduce(out, pp_group, average=False)
    return _all_reduce(out, dp_group, average=True)


@dataclass
class MoEReport:
    """Reduced values: ``averages`` (name -> mean over the model's MoE layers) and ``per_layer``
    (name -> one value per layer of the model, 0 for dense layers)."""
    averages: dict[str, float] = field(default_factory=dict)
    per_layer: dict[str, list[float]] = field(default_factory=dict)


class MoEMetrics:
    """The trainer's MoE bookkeeping for one model (or this rank's pipeline stages)."""

    def __init__(self, modules: nn.Module | Iterable[nn.Module], config: TransformerConfig, *,
                 device: torch.device | str = "cpu", per_token_loss: bool = False) -> None:
        self.routers = moe_routers(modules)
        for r in self.routers:
            r.calculate_per_token_loss = per_token_loss
        self.names = logged_names(config)
        self.num_layers = config.num_layers + getattr(config, "mtp_num_layers", 0)  # multi-token prediction's after
        self.num_moe_layers = config.num_moe_layers + getattr(config, "mtp_moe_layers", 0)  # Megatron counts both
        self.device = torch.device(device)
        self._bias = any(r.expert_bias is not None for r in self.routers)
        self._zero = torch.zeros((), device=self.device)
        self._interval: torch.Tensor | None = None  # [names, layers] summed over the interval's iterations
        self._last: torch.Tensor | None = None  # [names, layers] of the last iteration
        self.iterations = 0  # in the interval

    @classmethod
    def for_model(cls, modules: nn.Module | Iterable[nn.Module], config: Any, **kwargs: Any) -> "MoEMetrics | None":
        """The bookkeeping of a model with MoE layers; None for a dense model (which pays nothing)."""
        if getattr(config, "num_moe_experts", None) is None:
            return None
        return cls(modules, config, **kwargs)


    def after_backward(self, num_micro_batches: int) -> None:
        """After the iteration's last backward (before clipping and the optimizer step): expert-bias
        update, global_aux_loss counts reset, the iteration's values gathered (device work only)."""
        if self._bias:
            update_expert_biases(self.routers)
        reset_global_aux_loss(self.routers)
        rows, accumulators = [], []
        for name in self.names:
            by_layer: dict[int, torch.Tensor] = {}
            for r in self.routers:
                acc = r.logged.get(name)
                if acc is not None:
                    accumulators.append(acc)
                    by_layer[r.layer_number] = by_layer[r.layer_number] + acc if r.layer_number in by_layer else acc
            rows.append(torch.stack([by_layer.get(i, self._zero).to(self.device) for i in range(self.num_layers)]))
        table = (torch.stack(rows) if rows else torch.zeros(0, self.num_layers, device=self.device)) \
            / max(num_micro_batches, 1)
        if accumulators:
            torch._foreach_zero_(accumulators)
        self._last = table
        self._interval = table.clone() if self._interval is None else self._interval.add_(table)
        self.iterations += 1

    def read(self, *, last: bool = False, interval: bool = False, pp_group: Any = None,
             dp_group: Any = None) -> dict[str, MoEReport]:
        """The last iteration's values (``"last"``) and / or the log interval's averages
        (``"interval"``, which then starts again), reduced over the ranks in one go. A collective
        when groups are given: every rank of them calls it at the same iteration."""
        parts: list[tuple[str, torch.Tensor]] = []
        empty = torch.zeros(len(self.names), self.num_layers, device=self.device)
        if last:
            parts.append(("last", self._last if self._last is not None else empty))
        if interval:
            total = self._interval if self._interval is not None else empty
            parts.append(("interval", total / max(self.iterations, 1)))
            self._interval, self.iterations = None, 0
        if not parts:
            return {}
        stacked = reduce_layer_values(torch.stack([t for _, t in parts]), self.names, self.routers,
                                      pp_group=pp_group, dp_group=dp_group)
        averages = (stacked.sum(dim=-1) / max(self.num_moe_layers, 1)).tolist()
        per_layer = stacked.tolist()
        return {key: MoEReport(dict(zip(self.names, averages[k])), dict(zip(self.names, per_layer[k])))
                for k, (key, _) in enumerate(parts)}
