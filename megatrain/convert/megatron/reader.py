"""Reading a Megatron-LM checkpoint directory, in either of its formats, into canonical tensors.

* ``torch_dist`` (megatron-core dist checkpointing): ``iter_XXXXXXX/metadata.json``
  (``{"sharded_backend": "torch_dist", ...}``), ``common.pt`` (the run's ``args``, iteration, the
  schedule) and a torch DCP checkpoint (``.metadata``, ``__*.distcp``) whose keys are
  megatron-core's sharded keys: global, layout-independent tensors, the transformer layers stacked
  along a first dim of ``num_layers`` (``decoder.layers.self_attention.linear_qkv.weight`` is
  [L, (n + 2g) d, h]) and SwiGLU's ``linear_fc1`` already as [gate; up]. Any TP/PP layout reads alike.
* ``torch`` (legacy): ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt``, one pickle per
  tensor- x pipeline-parallel rank; each stage numbers its layers from 0, each TP rank holds its shard.

`read_megatron_checkpoint` returns a `MegatronCheckpoint`: canonical Megatron tensors
(`megatrain.convert.megatron.names`), the stored ``args``, iteration and consumed samples, Adam's
state where a torch_dist checkpoint holds it in model space (`megatrain.convert.megatron.optim`) or a
legacy one by parameter index (`megatrain.convert.megatron.legacy_optim`, each rank's moments joined
across TP ranks as its weights), the fp16 loss scaler's state, and what was left out (other optimizer
layouts, state refused). Pickles are read only through `megatrain.convert.megatron.pickles`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from megatrain.checkpoint.dcp_reader import load_dcp
from megatrain.checkpoint.errors import CheckpointError
from megatrain.checkpoint.ranks import single_process_quiet
from megatrain.convert.megatron.legacy_optim import LegacyOptimizerRefused, grad_scaler_state, rank_optimizer_state
from megatrain.convert.megatron.names import UnsupportedMegatronModel, canonical_name, layer_of, merge_tp, with_layer
from megatrain.convert.megatron.optim import MegatronOptimizerState, read_optimizer_state
from megatrain.convert.megatron.pickles import load_megatron_dcp_metadata, load_megatron_pt

__all__ = ["MegatronCheckpoint", "TRACKER", "find_megatron_iteration", "is_megatron_checkpoint",
           "read_megatron_checkpoint"]

TRACKER = "latest_checkpointed_iteration.txt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


@dataclass
class MegatronCheckpoint:
    """One Megatron checkpoint, read: canonical tensors by name and what the run stored beside them."""

    path: str
    format: str  # "torch_dist" or "torch"
    iteration: int
    args: argparse.Namespace | None
    tensors: dict[str, torch.Tensor]
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    scheduler: dict[str, Any] | None = None
    left_out: list[str] = field(default_factory=list)  # what is not converted, and why, for the note
    optimizer: MegatronOptimizerState | None = None  # Adam's state, where the checkpoint holds it in a layout read
    grad_scaler: dict[str, Any] | None = None  # the fp16 dynamic loss scaler's scale and trackers


def _iter_name(it: int | str) -> str:
    return "release" if it == "release" else f"iter_{int(it):07d}"


def _looks_megatron(d: str) -> bool:
    if not os.path.isdir(d) or os.path.isfile(os.path.join(d, "meta.json")):  # meta.json: megatrain's own
        return False
    if os.path.isfile(os.path.join(d, "metadata.json")):
        return True
    return any(_RANK_DIR.match(n) for n in os.listdir(d))


def find_megatron_iteration(load: str, step: int | None = None) -> str | None:
    """The iteration directory of a Megatron checkpoint ``load`` names (a save directory with
    ``latest_checkpointed_iteration.txt``, or one ``iter_`` directory), or None when it holds none."""
    if _looks_megatron(load):
        return load
    tracker = os.path.join(load, TRACKER)
    if step is not None:
        d = os.path.join(load, _iter_name(step))
        return d if _looks_megatron(d) else None
    if not os.path.isfile(tracker):
        return None
    text = open(tracker, encoding="utf-8", errors="replace").read().strip()
    if text != "release" and not text.isdigit():
        raise CheckpointError(f"{tracker}: holds {text[:40]!r}, not an iteration number")
    d = os.path.join(load, _iter_name(text if text == "release" else int(text)))
    return d if _looks_megatron(d) else None


def is_megatron_checkpoint(load: str | None, step: int | None = None) -> bool:
    """``load`` holds a Megatron-LM checkpoint (torch_dist or legacy torch), not a megatrain one."""
    if not load or not os.path.isdir(load):
        return False
    try:
        return find_megatron_iteration(load, step) is not None
    except CheckpointError:
        return False


def _counters(ck: MegatronCheckpoint, common: dict[str, Any]) -> None:
    args = ck.args
    if args is not None:
        ck.consumed_train_samples = int(getattr(args, "consumed_train_samples", 0) or 0)
        ck.consumed_valid_samples = int(getattr(args, "consumed_valid_samples", 0) or 0)
    sched = common.get("opt_param_scheduler") or common.get("lr_scheduler")
    ck.scheduler = sched if isinstance(sched, dict) else None
    ck.grad_scaler = grad_scaler_state(common.get("optimizer"))


def _iteration(d: str, common: dict[str, Any]) -> int:
    it = common.get("iteration")
    if isinstance(it, int):
        return it
    m = re.match(r"^iter_(\d+)$", os.path.basename(os.path.normpath(d)))
    return int(m.group(1)) if m else 0


def _read_torch_dist(d: str, progress: bool) -> MegatronCheckpoint:
    meta_path = os.path.join(d, "metadata.json")
    try:
        with open(meta_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: not a dist-checkpoint metadata.json ({e})") from None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if backend != "torch_dist":
        raise CheckpointError(f"{meta_path}: sharded_backend {backend!r}; megatrain reads Megatron's torch_dist "
                              "format (re-save with --ckpt-format torch_dist, or convert zarr with Megatron first)")
    common_path = os.path.join(d, "common.pt")
    common = load_megatron_pt(common_path) if os.path.isfile(common_path) else {}
    if not isinstance(common, dict):
        raise CheckpointError(f"{common_path}: not a dict")
    md = load_megatron_dcp_metadata(d)
    args = common.get("args")
    ck = MegatronCheckpoint(d, "torch_dist", _iteration(d, common), args if isinstance(args, argparse.Namespace)
                            else None, {})
    _counters(ck, common)
    keys = [k for k, v in md.state_dict_metadata.items() if hasattr(v, "size") and k.startswith(_MODEL_PREFIXES)]
    for key in tqdm(keys, desc="reading torch_dist", disable=not progress):
        ck.tensors.update(read_sharded_key(d, md, key, key))
    ck.left_out = [x for x in ck.left_out if not x.startswith("optimizer state")]
    ck.optimizer = read_optimizer_state(d, md, common, keys, ck.args, ck.iteration, ck.left_out,
                                        lambda stored, key: read_sharded_key(d, md, stored, key))
    return ck


def read_sharded_key(d: str, md: Any, stored: str, key: str) -> dict[str, torch.Tensor]:
    """The canonical tensors of one torch_dist tensor ``stored`` whose model key is ``key`` (itself, or
    the parameter an optimizer-state tensor ``optimizer.state.exp_avg.KEY`` belongs to): the stacked
    layer tensors ([L, ...], routed experts [L, E, ...]) cut into one tensor per layer (and expert)."""
    item = md.state_dict_metadata[stored]
    t = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    with single_process_quiet():
        load_dcp({stored: t}, d, md, allow_partial_load=True)
    out: dict[str, torch.Tensor] = {}
    if key.startswith("decoder.layers.") and layer_of(key) is None:  # stacked: [num_layers, ...]
        rest = key[len("decoder.layers."):]
        # only the layers its chunks cover (dense and MoE layers of one model stack separately)
        covered = sorted({c.offsets[0] + i for c in item.chunks for i in range(c.sizes[0])})
        for i in covered:
            if rest.startswith("mlp.experts.experts."):  # routed experts: [L, E, ...]
                for e in range(t.shape[1]):
                    name = f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{rest[len('mlp.experts.experts.'):]}"
                    out[name] = t[i, e].clone()
                continue
            name = canonical_name(f"decoder.layers.{i}.{rest}")
            if name is not None:
                out[name] = t[i].clone()
    else:
        name = canonical_name(key)
        if name is not None:
            out[name] = t
    return out


def _stage_model(sd: dict[str, Any], path: str) -> dict[str, torch.Tensor]:
    if "model" not in sd:
        if any(k.startswith("model") and k[5:].isdigit() for k in sd):
            raise UnsupportedMegatronModel(f"{path}: a virtual-pipeline checkpoint (model0, model1, ...); convert it "
                                           "without --num-layers-per-virtual-pipeline-stage first")
        raise CheckpointError(f"{path}: holds no 'model' entry")
    model = sd["model"]
    if not isinstance(model, dict):
        raise CheckpointError(f"{path}: its 'model' entry is not a state dict")
    if any(k.startswith("language_model.") for k in model):
        raise UnsupportedMegatronModel(f"{path}: a checkpoint of Megatron-LM's legacy (non-core) GPT model "
                                       "(language_model.*); only megatron-core models convert")
    out = {}
    for k, v in model.items():
        name = canonical_name(k)
        if name is not None and isinstance(v, torch.Tensor):
            out[name] = v
    return out


def _read_legacy(d: str, progress: bool) -> MegatronCheckpoint:
    ranks: dict[tuple[int, int], str] = {}
    for n in os.listdir(d):
        m = _RANK_DIR.match(n)
        if m:
            ranks[(int(m.group(2) or 0), int(m.group(1)))] = os.path.join(d, n, "model_optim_rng.pt")
        elif n.startswith("mp_rank_"):
            raise UnsupportedMegatronModel(f"{d}/{n}: an expert-parallel rank directory; only TP x PP legacy "
                                           "checkpoints convert")
    pp = 1 + max(p for p, _ in ranks)
    tp = 1 + max(t for _, t in ranks)
    if len(ranks) != pp * tp:
        raise CheckpointError(f"{d}: has {len(ranks)} mp_rank_* directories, not TP {tp} x PP {pp}")
    for path in ranks.values():
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing")
    ck: MegatronCheckpoint | None = None
    offset = 0
    optim: _LegacyAdam | None = None
    bar = tqdm(total=pp * tp, desc="reading mp_rank files", disable=not progress)
    for stage in range(pp):
        shards: list[dict[str, torch.Tensor]] = []
        opt_shards: list[Any] = []
        for r in range(tp):
            path = ranks[(stage, r)]
            sd = load_megatron_pt(path)
            if not isinstance(sd, dict):
                raise CheckpointError(f"{path}: not a dict")
            if ck is None:
                args = sd.get("args")
                ck = MegatronCheckpoint(d, "torch", _iteration(d, sd),
                                        args if isinstance(args, argparse.Namespace) else None, {})
                _counters(ck, sd)
                optim = _LegacyAdam.start(ck, sd, path)
            shards.append(_stage_model(sd, path))
            if optim is not None:
                opt_shards.append(optim.rank(sd, path))
            del sd
            bar.update(1)
        args = ck.args
        swiglu = bool(getattr(args, "swiglu", False))
        names = list(shards[0])
        layers = sorted({layer_of(n) for n in names if layer_of(n) is not None})
        for name in names:
            if any(name not in s for s in shards):
                raise CheckpointError(f"{d}: {name} is missing from some tensor-parallel ranks of stage {stage}")
            t = merge_tp(name, [s[name] for s in shards], swiglu)
            local = layer_of(name)
            ck.tensors[with_layer(name, offset + local) if local is not None else name] = t
        if optim is not None and optim.ok:
            optim.merge(opt_shards, swiglu, offset)
        offset += len(layers)
    bar.close()
    assert ck is not None
    if optim is not None:
        ck.optimizer = optim.finish()
    return ck


class _LegacyAdam:
    """Adam's state of a legacy checkpoint, gathered rank file by rank file (`legacy_optim`) and its
    tensor-parallel shards merged as the weights are (`merge_tp`, the stages' layers renumbered)."""

    def __init__(self, ck: MegatronCheckpoint) -> None:
        self.ck, self.ok, self.steps = ck, True, set()
        self.state = MegatronOptimizerState("optimizer (legacy torch format)", 0)
        self.mains = True

    @classmethod
    def start(cls, ck: MegatronCheckpoint, sd: dict[str, Any], path: str) -> _LegacyAdam | None:
        """None where the first rank file holds no optimizer state megatrain reads (the reason in ``left_out``)."""
        rank_dir = os.path.dirname(path)
        if os.path.isfile(os.path.join(rank_dir, "distrib_optim.pt")) or (
                sd.get("optimizer") is not None and getattr(ck.args, "use_distributed_optimizer", False)):
            ck.left_out.append("optimizer state (the distributed optimizer's legacy per-DP-rank distrib_optim.pt "
                               "files, by bucket; re-save as torch_dist with --dist-ckpt-optim-fully-reshardable)")
            return None
        if sd.get("optimizer") is None:
            return None
        name = str(getattr(ck.args, "optimizer", "adam") or "adam")
        if name != "adam":
            ck.left_out.append(f"optimizer state ({name}; megatrain converts Adam's)")
            return None
        return cls(ck)

    def rank(self, sd: dict[str, Any], path: str) -> Any:
        if not self.ok:
            return None
        if sd.get("optimizer") is None:
            return self._refuse(f"{path}: holds no optimizer entry (other rank files do)")
        try:
            return rank_optimizer_state(sd, sd["model"], self.ck.args, path)
        except LegacyOptimizerRefused as e:
            return self._refuse(str(e))
        except (TypeError, ValueError, KeyError, AttributeError) as e:  # a malformed entry: one line, not a trace
            return self._refuse(f"{path}: its optimizer entry is malformed ({type(e).__name__}: {e})"
                                .replace("\n", " ")[:300])

    def _refuse(self, why: str) -> None:
        self.ok = False
        self.ck.left_out.append(f"optimizer state (refused, not guessed: {why})")
        return None

    def merge(self, shards: list[Any], swiglu: bool, offset: int) -> None:
        if any(s is None for s in shards):
            return
        self.steps.update(s["step"] for s in shards if s["step"] is not None)
        self.mains = self.mains and all(s["main"] for s in shards)
        for kind, target in (("exp_avg", self.state.exp_avg), ("exp_avg_sq", self.state.exp_avg_sq),
                             ("main", self.state.main_params)):
            if kind == "main" and not self.mains:
                continue
            for name in shards[0][kind]:
                if any(name not in s[kind] for s in shards):
                    self._refuse(f"{name}: Adam state on only some tensor-parallel ranks")
                    return
                t = merge_tp(name, [s[kind][name] for s in shards], swiglu)
                local = layer_of(name)
                target[with_layer(name, offset + local) if local is not None else name] = t

    def finish(self) -> MegatronOptimizerState | None:
        if not self.ok:
            return None
        if len(self.steps) > 1:
            self._refuse(f"the rank files' steps differ ({sorted(self.steps)[:4]})")
            return None
        self.state.step = self.steps.pop() if self.steps else int(self.ck.iteration)
        if not self.mains:
            self.state.main_params = {}
        return self.state


def read_megatron_checkpoint(load: str, step: int | None = None, progress: bool = True) -> MegatronCheckpoint:
    """The Megatron checkpoint in ``load`` (save directory or ``iter_`` directory), read on CPU."""
    d = find_megatron_iteration(load, step)
    if d is None:
        raise CheckpointError(f"{load}: no Megatron-LM checkpoint (latest_checkpointed_iteration.txt and an "
                              "iter_XXXXXXX directory with metadata.json or mp_rank_* files)")
    dist = os.path.isfile(os.path.join(d, "metadata.json"))
    ck = _read_torch_dist(d, progress) if dist else _read_legacy(d, progress)
    if ck.args is None:
        raise CheckpointError(f"{d}: holds no 'args' (Megatron stores the run's arguments with every checkpoint); "
                              "cannot tell the model's shape")
    layers = {layer_of(n) for n in ck.tensors if layer_of(n) is not None}
    want = int(getattr(ck.args, "num_layers", len(layers)) or len(layers))
    if len(layers) != want:
        raise CheckpointError(f"{d}: holds {len(layers)} transformer layers, its args say --num-layers {want}")
    return ck
