"""Adam's optimizer state in megatron-core ``torch_dist`` checkpoints: read (`read_optimizer_state`) and
the keys and ``common.pt`` entry written back (`optimizer_sharded_tensors`, `optimizer_common`).

megatron-core keeps the optimizer state "in model space" when a checkpoint is saved with
``optimizer.sharded_state_dict(model_sharded_state_dict)`` by the non-distributed optimizer
(``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``) or by the distributed optimizer with
``--dist-ckpt-optim-fully-reshardable``: one DCP tensor per parameter and state,
``optimizer.state.{exp_avg,exp_avg_sq}.<model key>`` of the model key's global shape (the layers
stacked, [L, ...], SwiGLU's ``linear_fc1`` as [gate; up]), the fp32 main params beside them under
``optimizer.state.fp32_param.<key>`` (mixed precision, non-distributed) or
``optimizer.state.param.<key>`` (distributed), ``chained_N.`` in front when a run chains
optimizers (MoE's expert parameters) without ``chained_optim_avoid_prefix``. The step is in
``common.pt``: ``optimizer[...].state.common_step`` (torch's Adam) or the param groups' ``step``
(Transformer Engine's / Apex's FusedAdam, the distributed optimizer).

Not read (`read_optimizer_state` gives None and says why in ``left_out``): the distributed optimizer's
default ``dp_reshardable`` layout (flat buffers by bucket, ``optimizer.distributed.*``, tied to that
run's buffer layout) and its older ``fully_sharded_model_space`` one (each DP rank's flattened range),
optimizers other than Adam, and states that do not cover every parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from megatrain.checkpoint.errors import CheckpointError

__all__ = ["MegatronOptimizerState", "read_optimizer_state", "optimizer_sharded_tensors", "optimizer_common",
           "MOMENTS"]

MOMENTS = ("exp_avg", "exp_avg_sq")
_MODEL_SPACE = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(exp_avg|exp_avg_sq|fp32_param|param)\.(.+)$")
_BUFFERS = ("_extra_state", ".expert_bias")  # model keys of buffers, which no optimizer steps
# megatrain's param-group entries that Megatron's groups carry too (the kernel choices are each run's own)
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "wd_mult", "lr_mult", "max_lr", "min_lr",
              "default_config", "is_expert_parallel", "is_decoupled_lr")


@dataclass
class MegatronOptimizerState:
    """Adam's state of one Megatron checkpoint by canonical Megatron name (as the weights are in
    `megatrain.convert.megatron.reader.MegatronCheckpoint.tensors`)."""

    layout: str  # for the notes: "optimizer" or "distributed optimizer (fully_reshardable)"
    step: int
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    main_params: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32 main params; empty when none


def _steps(obj: Any, out: list[int]) -> None:
    """Every step count in a ``common.pt`` optimizer entry: ``common_step`` and param groups' ``step``."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            scalar = isinstance(v, (int, float)) and not isinstance(v, bool) or (
                isinstance(v, torch.Tensor) and v.numel() == 1)
            if k in ("common_step", "step") and scalar:
                out.append(int(v.item() if isinstance(v, torch.Tensor) else v))
            else:
                _steps(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _steps(v, out)


def _sharding_type(common_opt: Any, content: Any) -> str | None:
    """The distributed optimizer's sharding type: the ``content_metadata`` Megatron-LM saves in
    ``common.pt``, else the ``param_state_sharding_type`` entry; None for the non-distributed optimizer."""
    if isinstance(content, dict) and content.get("distrib_optim_sharding_type"):
        return str(content["distrib_optim_sharding_type"])
    found: list[str] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            if isinstance(o.get("param_state_sharding_type"), str):
                found.append(o["param_state_sharding_type"])
            for v in o.values():
                walk(v)
    walk(common_opt)
    return found[0] if found else None


def read_optimizer_state(d: str, md: Any, common: dict[str, Any], model_keys: list[str], args: Any, iteration: int,
                         left_out: list[str], read_key: Any) -> MegatronOptimizerState | None:
    """Adam's state in the torch_dist checkpoint ``d`` (DCP metadata ``md``), or None (a reason appended
    to ``left_out`` when it holds optimizer state megatrain does not read). ``read_key(stored, key)``:
    the canonical tensors of one stored tensor whose model key is ``key`` (the reader's own)."""
    items = {k: v for k, v in md.state_dict_metadata.items() if k.startswith(("optimizer.", "chained_"))}
    common_opt = common.get("optimizer")
    if not items and common_opt is None:
        return None
    sharding = _sharding_type(common_opt, common.get("content_metadata"))
    distributed = sharding is not None or any(".distributed." in k or k.startswith("optimizer.distributed")
                                              for k in items)
    layout = f"distributed optimizer ({sharding or 'dp_reshardable'})" if distributed else "optimizer"
    if any(k.startswith("optimizer.distributed.") or ".optimizer.distributed." in k for k in items):
        left_out.append(f"optimizer state (the {layout} layout: flat buffers by bucket, tied to that run's "
                        "layout; re-save it with --dist-ckpt-optim-fully-reshardable)")
        return None
    if sharding not in (None, "fully_reshardable"):  # fully_sharded_model_space: flattened per DP rank's range
        left_out.append(f"optimizer state (the {layout} layout; re-save it with --dist-ckpt-optim-fully-reshardable)")
        return None
    name = str(getattr(args, "optimizer", "adam") or "adam")
    if name != "adam":
        left_out.append(f"optimizer state ({name}; megatrain converts Adam's)")
        return None
    sizes = {k: tuple(md.state_dict_metadata[k].size) for k in model_keys}
    by_kind: dict[str, dict[str, str]] = {}
    for stored, item in items.items():
        m = _MODEL_SPACE.match(stored)
        if m is None or not hasattr(item, "size"):
            continue
        kind, key = m.group(1), m.group(2)
        if key not in sizes:
            left_out.append(f"optimizer state ({stored}: no model tensor {key})")
            return None
        if tuple(item.size) != sizes[key]:
            raise CheckpointError(f"{d}: optimizer tensor {stored} has shape {list(item.size)}, its parameter {key} "
                                  f"{list(sizes[key])}")
        by_kind.setdefault(kind, {})[key] = stored
    params = [k for k in model_keys if not k.endswith(_BUFFERS)]
    missing = [k for k in params for kind in MOMENTS if k not in by_kind.get(kind, {})]
    if missing:
        left_out.append(f"optimizer state (in a layout megatrain does not read: no exp_avg/exp_avg_sq for "
                        f"{missing[0]})" if not by_kind else f"optimizer state (incomplete: no Adam moments for "
                        f"{missing[0]})")
        return None
    steps: list[int] = []
    _steps(common_opt, steps)
    state = MegatronOptimizerState(layout, max(steps) if steps else int(iteration))
    mains = by_kind.get("fp32_param") or by_kind.get("param") or {}
    for kind, target in (("exp_avg", state.exp_avg), ("exp_avg_sq", state.exp_avg_sq), (None, state.main_params)):
        for key, stored in (by_kind[kind] if kind else mains).items():
            target.update(read_key(stored, key))
    if state.main_params and set(state.main_params) != set(state.exp_avg):
        state.main_params = {}  # main params for only some parameters: the model's own weights serve
    return state


def optimizer_sharded_tensors(moments: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """megatron-core's DCP keys of the non-distributed optimizer's state: ``optimizer.state.KIND.KEY``
    for each kind (``exp_avg``, ...) and stacked model key (``moments[kind]``: stacked tensors by key)."""
    out: dict[str, torch.Tensor] = {}
    for kind, stacked in moments.items():
        for key, t in stacked.items():
            if isinstance(t, torch.Tensor):
                out[f"optimizer.state.{kind}.{key}"] = t.float().contiguous()
    return out


def optimizer_common(step: int, groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``common.pt`` ``optimizer`` entry megatron-core's non-distributed optimizer loads with its
    sharded tensors: torch's Adam state dict without the tensors, the step shared (``common_step``,
    and each group's ``step`` as FusedAdam keeps it), the groups without their ``params``."""
    out_groups = []
    for g in groups:
        entry = {k: g[k] for k in GROUP_KEYS if k in g}
        if isinstance(entry.get("betas"), list):
            entry["betas"] = tuple(entry["betas"])
        entry["step"] = int(step)
        out_groups.append(entry)
    return {"state": {"common_step": torch.tensor(float(step))}, "param_groups": out_groups}
