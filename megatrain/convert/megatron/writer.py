"""Writing Megatron-LM checkpoints from canonical tensors: megatron-core's ``torch_dist`` format
(`write_torch_dist`, what ``--saver mcore`` writes and megatron-core's ``dist_checkpointing.load``
reads) and the legacy ``torch`` format (`write_legacy`, ``--saver megatron``).

``torch_dist`` keys and shapes are megatron-core's sharded ones: the layers stacked along a first dim
(``decoder.layers.self_attention.linear_qkv.weight`` [L, ...]), the norms under Transformer Engine's
fused names (megatron-core's local spec maps its ``input_layernorm`` to them in its sharded state
dict, so both specs load it), SwiGLU's ``linear_fc1`` as [gate; up], and one ``_extra_state``
ShardedObject per layer and linear layer (``.../shard_{layer}_{L}``, a pickled ``[None]``, as megatron-core
writes for the local spec). ``common.pt`` holds the ``args`` (plain values), ``iteration`` and
``checkpoint_version`` 3.0 and the LR schedule (``opt_param_scheduler``), as Megatron's
``save_checkpoint`` does; Adam's state where given, in the non-distributed optimizer's layout
(``optimizer.state.exp_avg.<key>`` beside each model key, the step and param groups in ``common.pt``;
the legacy format's by parameter index in each rank file, `megatrain.convert.megatron.legacy_optim`);
no RNG (Megatron-LM loads it with ``--no-load-rng``). Every checkpoint is written into
``iter_XXXXXXX.tmp`` and renamed when complete; ``latest_checkpointed_iteration.txt`` is replaced
last, atomically.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
from collections import defaultdict
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from tqdm import tqdm

from megatrain.atomic_io import atomic_write_text
from megatrain.checkpoint.ranks import single_process_quiet
from megatrain.convert.megatron.legacy_optim import (group_templates, legacy_optimizer_entry, megatron_grad_scaler,
                                                     module_order)
from megatrain.convert.megatron.names import UnsupportedMegatronModel, layer_of, split_tp, te_layer_name, with_layer
from megatrain.convert.megatron.optim import (GROUP_KEYS, MOMENTS, MegatronOptimizerState, optimizer_common,
                                              optimizer_sharded_tensors)
from megatrain.convert.megatron.reader import TRACKER

__all__ = ["write_torch_dist", "write_legacy", "DIST_METADATA"]

DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}
_TO_TE = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
          "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
          "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
          "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2",
            # multi-latent attention's
            "self_attention.linear_q_proj", "self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
            "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj")


def _is_mla(tensors: dict[str, torch.Tensor], layer: int) -> bool:
    return f"decoder.layers.{layer}.self_attention.linear_kv_down_proj.weight" in tensors


def _is_moe(tensors: dict[str, torch.Tensor], layer: int) -> bool:
    return f"decoder.layers.{layer}.mlp.router.weight" in tensors


def _none_bytes() -> io.BytesIO:
    buf = io.BytesIO()
    torch.save([None], buf)  # megatron-core stores a ShardedObject as a list of its shards' data
    buf.seek(0)
    return buf


class _PackedBytesPlanner(DefaultSavePlanner):
    """Writes BytesIO values as they are (megatron-core's own planner does the same: its ShardedObjects
    arrive already serialized), where DCP's default planner would pickle the BytesIO object itself."""

    def transform_object(self, write_item: Any, object: Any) -> Any:  # noqa: A002 - DCP's name
        return object


#: the values of Megatron's ``OptimizerParamScheduler.state_dict`` (megatrain's schedule uses the same keys)
SCHEDULER_KEYS = ("max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps", "min_lr", "start_wd",
                  "end_wd", "wd_incr_style", "wd_incr_steps")


def _common(args: argparse.Namespace, iteration: int, scheduler: dict[str, Any] | None = None) -> dict[str, Any]:
    common: dict[str, Any] = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                              "num_floating_point_operations_so_far": 0}
    if scheduler and all(k in scheduler for k in SCHEDULER_KEYS):  # Megatron's load reads all ten
        common["opt_param_scheduler"] = {k: scheduler[k] for k in SCHEDULER_KEYS}
    return common


def _begin(save: str, iteration: int) -> tuple[str, str]:
    final = os.path.join(save, f"iter_{iteration:07d}")
    tmp = final + ".tmp"
    os.makedirs(save, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp, final


def _publish(save: str, tmp: str, final: str, iteration: int) -> str:
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    atomic_write_text(os.path.join(save, TRACKER), f"{iteration}\n", fsync=True)
    return final


def _stacked(tensors: dict[str, torch.Tensor], num_layers: int, te: bool = True) -> dict[str, Any]:
    """megatron-core's sharded keys: layer tensors stacked, TE norm names, the layers' _extra_state objects.
    Multi-latent attention's layers have no keys map in megatron-core's specs: the TE spec's names with ``te``
    (`names.te_layer_name`), else the local spec's (megatrain's)."""
    per_key: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        layer = layer_of(name)
        if layer is None:
            out[name] = t.contiguous()
            continue
        rest = name.split(".", 3)[3]
        if _is_mla(tensors, layer):
            key = te_layer_name(rest, mla=True, moe=_is_moe(tensors, layer)) if te else rest
        else:
            key = _TO_TE.get(rest, rest)
        per_key[key][layer] = t
    experts: dict[str, dict[int, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for rest in [r for r in per_key if r.startswith("mlp.experts.local_experts.")]:
        expert, inner = rest[len("mlp.experts.local_experts."):].split(".", 1)
        for layer, t in per_key.pop(rest).items():
            experts[inner][layer][int(expert)] = t
    for inner, by_layer in experts.items():  # megatron-core's routed experts: [L, E, ...]
        per_key[f"mlp.experts.experts.{inner}"] = {
            layer: torch.stack([e[i] for i in range(len(e))]) for layer, e in by_layer.items()}
    for rest, by_layer in per_key.items():
        if sorted(by_layer) != list(range(num_layers)):
            raise UnsupportedMegatronModel(f"decoder.layers.*.{rest}: not in every one of the {num_layers} layers")
        out[f"decoder.layers.{rest}"] = torch.stack([by_layer[i] for i in range(num_layers)]).contiguous()
    modules = [m for m in _LINEARS if f"decoder.layers.{m}.weight" in out]
    modules += [m for m in ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
                if f"decoder.layers.{m}.weight" in out]
    for module in modules:
        for i in range(num_layers):
            out[f"decoder.layers.{module}._extra_state/shard_{i}_{num_layers}"] = _none_bytes()
    for fc in ("linear_fc1", "linear_fc2"):  # routed experts' objects: layer and expert axes
        stacked = out.get(f"decoder.layers.mlp.experts.experts.{fc}.weight")
        if stacked is not None:
            n = stacked.shape[1]
            for i in range(num_layers):
                for e in range(n):
                    key = f"decoder.layers.mlp.experts.experts.{fc}._extra_state/shard_{i}.{e}_{num_layers}.{n}"
                    out[key] = _none_bytes()
    return out


def write_torch_dist(save: str, tensors: dict[str, torch.Tensor], args: argparse.Namespace, iteration: int,
                     scheduler: dict[str, Any] | None = None, *, optimizer: MegatronOptimizerState | None = None,
                     param_groups: list[dict[str, Any]] | None = None,
                     grad_scaler: dict[str, Any] | None = None, sixteen: torch.dtype | None = None) -> str:
    """``save/iter_XXXXXXX`` in megatron-core's torch_dist format; returns the directory. With
    ``optimizer`` (Adam's moments and step, canonical names) and its ``param_groups`` also the
    non-distributed optimizer's state (`megatrain.convert.megatron.optim`); with ``grad_scaler`` (an fp16
    run's dynamic loss scaler: scale, growth_tracker, hysteresis_tracker) or ``sixteen`` (a bf16 run) in the
    layout of megatron-core's ``Float16OptimizerWithFloat16Params``: the fp32 main params (the weights) as
    ``optimizer.state.fp32_param.<key>``, ``common.pt``'s ``optimizer`` as
    ``{"optimizer": ..., "grad_scaler": ...}``."""
    tmp, final = _begin(save, iteration)
    try:
        num_layers = int(args.num_layers)
        te = getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine"
        sd = _stacked(tensors, num_layers, te)
        common = _common(args, iteration, scheduler)
        if optimizer is not None:
            sd.update(optimizer_sharded_tensors({kind: _stacked(getattr(optimizer, kind), num_layers, te)
                                                 for kind in MOMENTS}))
            common["optimizer"] = optimizer_common(optimizer.step, param_groups or [])
            if grad_scaler is not None or sixteen is not None:
                sd.update(optimizer_sharded_tensors({"fp32_param": _stacked(tensors, num_layers, te)}))
                common["optimizer"] = {"optimizer": common["optimizer"]}
                if grad_scaler is not None:
                    common["optimizer"]["grad_scaler"] = megatron_grad_scaler(grad_scaler)
        with open(os.path.join(tmp, "metadata.json"), "w", encoding="utf-8") as f:
            json.dump(DIST_METADATA, f)
        torch.save(common, os.path.join(tmp, "common.pt"))
        with single_process_quiet():
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp, thread_count=1),
                     planner=_PackedBytesPlanner(), no_dist=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish(save, tmp, final, iteration)


def _legacy_stage(tensors: dict[str, torch.Tensor], stage: int, pp: int, num_layers: int, tied: bool,
                  te: bool) -> dict[str, torch.Tensor]:
    per_stage = num_layers // pp
    first, last = stage == 0, stage == pp - 1
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        layer = layer_of(name)
        if layer is not None:
            if stage * per_stage <= layer < (stage + 1) * per_stage:
                local = with_layer(name, layer - stage * per_stage)
                rest = local.split(".", 3)[3]
                moe = _is_moe(tensors, layer)  # TE keeps an MoE layer's norm apart
                renamed = te_layer_name(rest, mla=_is_mla(tensors, layer), moe=moe) if te else rest
                out[f"decoder.layers.{layer - stage * per_stage}.{renamed}"] = t
        elif name.startswith("embedding."):
            if first:
                out[name] = t
        elif last:
            out[name] = t
    if last and tied and pp > 1:  # megatron-core's last stage keeps its own copy of the tied output weight
        out["output_layer.weight"] = tensors["embedding.word_embeddings.weight"]
    return out


def legacy_optimizer_plan(tensors: dict[str, torch.Tensor], optimizer: MegatronOptimizerState,
                          param_groups: list[dict[str, Any]] | None, pp: int, num_layers: int,
                          te: bool) -> tuple[Any, str | None]:
    """megatron-core's two param groups of megatrain's ``param_groups`` for `write_legacy`'s optimizer entries,
    or None and why the legacy format gets no optimizer state (a model whose parameter order is not known here)."""
    templates = group_templates(param_groups or [], GROUP_KEYS)
    if isinstance(templates, str):
        return None, templates
    for stage in range(pp):
        names = list(_legacy_stage(tensors, stage, pp, num_layers, False, te))
        if module_order(names) is None:
            return None, "a model whose megatron-core parameter order megatrain does not know (mixture of experts)"
    if any(name not in getattr(optimizer, kind) for name in tensors for kind in MOMENTS):
        return None, "Adam moments not for every weight"
    return templates, None


def write_legacy(save: str, tensors: dict[str, torch.Tensor], args: argparse.Namespace, iteration: int, *,
                 tp: int, pp: int, transformer_impl: str = "transformer_engine", progress: bool = True,
                 scheduler: dict[str, Any] | None = None, optimizer: MegatronOptimizerState | None = None,
                 param_groups: list[dict[str, Any]] | None = None, grad_scaler: dict[str, Any] | None = None,
                 sixteen: torch.dtype | None = None) -> str:
    """``save/iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` (legacy torch format) for TP x PP. With
    ``optimizer`` (canonical names) each file also gets megatron-core's non-distributed optimizer state
    (`legacy_optim.legacy_optimizer_entry`; the model's keys in megatron-core's parameter order): with
    ``sixteen`` (fp16/bf16) the weights in that dtype and the fp32 ones as ``fp32_from_fp16_params``
    (``Float16OptimizerWithFloat16Params``), ``grad_scaler`` its dynamic loss scaler's state."""
    num_layers = int(args.num_layers)
    if num_layers % pp:
        raise UnsupportedMegatronModel(f"--target-pipeline-parallel-size {pp} does not divide --num-layers "
                                       f"{num_layers}")
    swiglu, tied = bool(args.swiglu), not args.untie_embeddings_and_output_weights
    te = transformer_impl == "transformer_engine"
    templates = None
    if optimizer is not None:
        templates, why = legacy_optimizer_plan(tensors, optimizer, param_groups, pp, num_layers, te)
        if why:
            print(f" note: the optimizer state is not written ({why}); Megatron-LM starts it fresh", flush=True)
    tmp, final = _begin(save, iteration)
    try:
        bar = tqdm(total=tp * pp, desc="writing mp_rank files", disable=not progress)
        for stage in range(pp):
            sd = _legacy_stage(tensors, stage, pp, num_layers, tied, te)
            moments: dict[str, Any] = {}
            if templates is not None:
                assert optimizer is not None
                sd = {name: sd[name] for name in module_order(list(sd)) or sd}
                moments = {kind: _legacy_stage(getattr(optimizer, kind), stage, pp, num_layers, tied, te)
                           for kind in MOMENTS}
                moments = {kind: {name: split_tp(name, t, tp, swiglu, te) for name, t in m.items()}
                           for kind, m in moments.items()}
            shards = {name: split_tp(name, t, tp, swiglu, te) for name, t in sd.items()}
            for r in range(tp):
                model: dict[str, Any] = {name: parts[r].clone() for name, parts in shards.items()}
                entry = None
                if templates is not None:
                    assert optimizer is not None
                    mains = dict(model) if sixteen is not None else None
                    if sixteen is not None:
                        model = {name: t.to(sixteen) for name, t in model.items()}
                    entry = legacy_optimizer_entry(model, {k: {n: p[r] for n, p in m.items()}
                                                           for k, m in moments.items()},
                                                   optimizer.step, templates, args, mains, grad_scaler)
                for name in list(model):
                    if name.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
                                      "linear_fc2.weight", "output_layer.weight", "linear_q_proj.weight",
                                      "linear_q_down_proj.weight", "linear_q_up_proj.weight",
                                      "linear_kv_down_proj.weight", "linear_kv_up_proj.weight")):
                        model[name[: -len("weight")] + "_extra_state"] = None
                rank_dir = os.path.join(tmp, f"mp_rank_{r:02d}" if pp == 1 else f"mp_rank_{r:02d}_{stage:03d}")
                os.makedirs(rank_dir)
                state = {**_common(args, iteration, scheduler), "model": model}
                if entry is not None:
                    state["optimizer"] = entry
                torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
                bar.update(1)
        bar.close()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish(save, tmp, final, iteration)
