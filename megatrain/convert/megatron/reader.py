"""Reading a Megatron-LM checkpoint directory, in either of its formats, into canonical tensors.

* ``torch_dist`` (megatron-core dist checkpointing): ``iter_XXXXXXX/metadata.json``
  (``{"sharded_backend": "torch_dist", ...}``), ``common.pt`` (the run's ``args``, iteration, the
  schedule) and a torch DCP checkpoint (``.metadata``, ``__*.distcp``) whose keys are
  megatron-core's sharded keys: global, layout-independent tensors, the transformer layers stacked
  along a first dim of ``num_layers`` (``decoder.layers.self_attention.linear_qkv.weight`` is
  [L, (n + 2g) d, h]) and SwiGLU's ``linear_fc1`` already as [gate; up]. Any TP/PP layout reads alike.
* ``torch`` (legacy): ``iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``, one pickle per
  tensor- x pipeline- (x expert-) parallel rank; each stage numbers its layers from 0, each TP rank holds
  its shard, each expert-parallel rank its experts (local 0..E/EP-1, global ``ep_rank * E/EP + local``;
  the other weights replicated, expert rank 0's read). A virtual-pipeline (interleaved schedule) file
  holds ``model0``, ``model1``, ... (one per chunk); the global layers run chunk 0 of every stage, then
  chunk 1 of every stage, ... The optimizer state of virtual-pipeline and expert-parallel files is not
  mapped (a note; Adam starts fresh). Megatron-LM's pre-core ("legacy" model) GPT files, ``language_model.*``
  nested or flat, are renamed to megatron-core's names first (`names.legacy_name`; a checkpoint_version < 2.0
  file's ``query_key_value`` reordered as Megatron-LM's ``fix_query_key_value_ordering`` does).

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

from megatrain.checkpoint.errors import CheckpointError
from megatrain.checkpoint.ranks import single_process_quiet
from megatrain.convert.megatron.legacy_optim import LegacyOptimizerRefused, grad_scaler_state, rank_optimizer_state
from megatrain.convert.megatron.names import (UnsupportedMegatronModel, canonical_name, flatten_state_dict,
                                             is_legacy_model, layer_of, legacy_name, legacy_qkv_fix, merge_tp,
                                             with_layer)
from megatrain.convert.megatron.optim import MegatronOptimizerState, read_optimizer_state

__all__ = ["MegatronCheckpoint", "TRACKER", "find_megatron_iteration", "is_megatron_checkpoint",
           "read_megatron_checkpoint"]

TRACKER = "latest_checkpointed_iteration.txt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
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
    # DCP's modules load on use: every run's parse_args asks is_megatron_checkpoint
    from megatrain.convert.megatron.pickles import load_megatron_dcp_metadata, load_megatron_pt

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
    from megatrain.checkpoint.dcp_reader import load_dcp

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


def _renamed_legacy(sd: dict[str, Any], model: dict[str, Any], path: str, tp: int) -> dict[str, Any]:
    """A pre-core ("legacy", ``language_model.*``) GPT model entry, nested or flat, flattened and renamed to
    megatron-core's names in its own order (`names.legacy_name`), a ``checkpoint_version`` < 2.0 file's
    ``query_key_value`` reordered per head as Megatron-LM's ``fix_query_key_value_ordering`` does."""
    version = sd.get("checkpoint_version", 0)  # Megatron-LM reads a file without one as version 0
    try:
        version = float(version)
    except (TypeError, ValueError):
        raise CheckpointError(f"{path}: checkpoint_version {version!r} is not a number") from None
    fix = None
    if version < 2.0:
        args = sd.get("args")
        heads = int(getattr(args, "num_attention_heads", 0) or 0)
        if not heads or heads % tp:
            raise UnsupportedMegatronModel(f"{path}: checkpoint_version {version} and no --num-attention-heads "
                                           f"dividing over TP {tp} in its args: its query_key_value order is unknown")
        if getattr(args, "group_query_attention", False):
            raise UnsupportedMegatronModel(f"{path}: checkpoint_version {version} with --group-query-attention")
        head_dim = int(getattr(args, "kv_channels", None) or int(args.hidden_size) // heads)
        try:
            fix = legacy_qkv_fix(version, heads // tp, head_dim)
        except UnsupportedMegatronModel as e:
            raise UnsupportedMegatronModel(f"{path}: {e}") from None
    out: dict[str, Any] = {}
    for k, v in flatten_state_dict(model).items():
        try:
            name = legacy_name(k)
        except UnsupportedMegatronModel as e:
            raise UnsupportedMegatronModel(f"{path}: {e}") from None
        if name is None or not isinstance(v, torch.Tensor):
            continue
        if name in out:
            raise CheckpointError(f"{path}: two legacy weights read as {name}")
        if fix is not None and name.endswith(("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")):
            try:
                v = fix(v)
            except UnsupportedMegatronModel as e:
                raise UnsupportedMegatronModel(f"{path}: {e}") from None
        out[name] = v
    if fix is not None:
        out[_QKV_FIX] = fix  # not a tensor: read by `_read_legacy` for Adam's moments, left out of the weights
    return out


_QKV_FIX = "__legacy_qkv_fix__"


def _stage_models(sd: dict[str, Any], path: str, tp: int = 1) -> list[dict[str, torch.Tensor]]:
    """The model chunks of one rank file: ``[model]``, or a virtual-pipeline file's ``model0``, ``model1``, ...
    (one per virtual chunk, in chunk order), each by canonical name with the chunk's local layer numbers."""
    if "model" in sd:
        entries = [sd["model"]]
    else:
        vp = sorted(int(k[5:]) for k in sd if isinstance(k, str) and k.startswith("model") and k[5:].isdigit())
        if not vp:
            raise CheckpointError(f"{path}: holds no 'model' entry")
        if vp != list(range(len(vp))):
            raise CheckpointError(f"{path}: virtual-pipeline chunks {vp[:6]} (not model0..model{len(vp) - 1})")
        entries = [sd[f"model{i}"] for i in vp]
    out = []
    for model in entries:
        if not isinstance(model, dict):
            raise CheckpointError(f"{path}: its 'model' entry is not a state dict")
        if is_legacy_model(model):
            model = _renamed_legacy(sd, model, path, tp)
            if "model" in sd:
                sd["model"] = model  # the optimizer's parameter order: the file's own, under the new names
        chunk = {}
        for k, v in model.items():
            name = canonical_name(k)
            if name is not None and isinstance(v, torch.Tensor):
                chunk[name] = v
        out.append(chunk)
    return out


def _rank_layout(d: str, loaded: dict[str, Any]) -> tuple[dict[tuple[int, int, int], str], int, int, int]:
    """The rank files of a legacy directory by (pipeline, expert, tensor) rank, and PP, EP, TP. Megatron-LM
    names them ``mp_rank_{tp:02d}``, ``_{pp:03d}`` with pipeline parallelism, then ``_{ep:03d}`` with expert
    parallelism; ``mp_rank_TT_XXX`` is told apart (PP or EP) by the run's args (the file read for them is
    kept in ``loaded``, by path)."""
    from megatrain.convert.megatron.pickles import load_megatron_pt

    found: dict[tuple[int, int | None, int | None], str] = {}
    for n in os.listdir(d):
        m = _RANK_DIR.match(n)
        if m:
            found[(int(m.group(1)), None if m.group(2) is None else int(m.group(2)),
                   None if m.group(3) is None else int(m.group(3)))] = os.path.join(d, n, "model_optim_rng.pt")
        elif n.startswith("mp_rank_"):
            raise CheckpointError(f"{d}/{n}: not a Megatron-LM rank directory name (mp_rank_TT[_PPP][_EEE])")
    kinds = {(a is None, b is None) for _, a, b in found}
    if len(kinds) != 1:
        raise CheckpointError(f"{d}: mp_rank_* directories of mixed forms")
    two, one = kinds.pop() == (False, False), any(a is not None for _, a, _ in found)
    as_ep = False
    if one and not two:
        first = found.get((0, 0, None))
        if first is None or not os.path.isfile(first):
            raise CheckpointError(f"{d}: no mp_rank_00_000 rank file")
        loaded[first] = load_megatron_pt(first)
        args = loaded[first].get("args") if isinstance(loaded[first], dict) else None
        ep_size = int(getattr(args, "expert_model_parallel_size", 1) or 1)
        pp_size = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        as_ep = ep_size > 1 and pp_size == 1
    ranks: dict[tuple[int, int, int], str] = {}
    for (t, a, b), path in found.items():
        if two:
            ranks[(a, b, t)] = path
        elif as_ep:
            ranks[(0, a or 0, t)] = path
        else:
            ranks[(a or 0, 0, t)] = path
    pp, ep, tp = (1 + max(k[i] for k in ranks) for i in range(3))
    if len(ranks) != pp * ep * tp:
        raise CheckpointError(f"{d}: has {len(ranks)} mp_rank_* directories, not TP {tp} x PP {pp} x EP {ep}")
    for path in ranks.values():
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing")
    return ranks, pp, ep, tp


def _with_expert(name: str, offset: int) -> str:
    """``...mlp.experts.local_experts.L.rest`` as global expert ``offset + L`` (megatron-core numbers an expert
    rank's local experts from ``ep_rank * num_local_experts``)."""
    m = _EXPERT.match(name)
    return f"{m.group(1)}{offset + int(m.group(2))}{m.group(3)}" if m else name


_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _transformer_engine(args: Any) -> bool:
    """The run used Megatron's Transformer Engine spec (its default; the local spec splits multi-latent
    attention's down projections over the tensor-parallel ranks, TE's TELinear keeps them whole)."""
    return (getattr(args, "transformer_impl", None) or "transformer_engine") == "transformer_engine"


def _read_legacy(d: str, progress: bool) -> MegatronCheckpoint:
    from megatrain.convert.megatron.pickles import load_megatron_pt

    loaded: dict[str, Any] = {}
    ranks, pp, ep, tp = _rank_layout(d, loaded)
    ck: MegatronCheckpoint | None = None
    optim: _LegacyAdam | None = None
    vp: int | None = None
    chunks: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (stage, chunk): local layer numbers
    stage_opt: dict[int, list[Any]] = {}
    bar = tqdm(total=pp * ep * tp, desc="reading mp_rank files", disable=not progress)
    for stage in range(pp):
        for e in range(ep):
            shards: list[list[dict[str, torch.Tensor]]] = []
            opt_shards: list[Any] = []
            for r in range(tp):
                path = ranks[(stage, e, r)]
                sd = loaded.pop(path) if path in loaded else load_megatron_pt(path)
                if not isinstance(sd, dict):
                    raise CheckpointError(f"{path}: not a dict")
                models = _stage_models(sd, path, tp)
                if ck is None:
                    args = sd.get("args")
                    ck = MegatronCheckpoint(d, "torch", _iteration(d, sd),
                                            args if isinstance(args, argparse.Namespace) else None, {})
                    _counters(ck, sd)
                    vp = len(models)
                    etp = getattr(ck.args, "expert_tensor_parallel_size", None)
                    if ep > 1 and etp is not None and int(etp) != tp:
                        raise UnsupportedMegatronModel(f"{d}: --expert-tensor-parallel-size {etp} differs from the "
                                                       f"tensor-parallel size {tp}; only equal ones convert")
                    if vp > 1 or ep > 1:
                        if sd.get("optimizer") is not None:
                            what = "virtual-pipeline" if vp > 1 else "expert-parallel"
                            ck.left_out.append(f"optimizer state (a legacy {what} checkpoint's, not mapped: "
                                               "Adam starts fresh)")
                    else:
                        optim = _LegacyAdam.start(ck, sd, path)
                if len(models) != vp:
                    raise CheckpointError(f"{path}: holds {len(models)} model chunks, other rank files {vp}")
                shards.append(models)
                if optim is not None:
                    opt_shards.append(optim.rank(sd, path))
                del sd
                bar.update(1)
            assert ck is not None and vp is not None
            swiglu = bool(getattr(ck.args, "swiglu", False))
            te = _transformer_engine(ck.args)
            num_local = None
            for c in range(vp):
                names = list(shards[0][c])
                target = chunks.setdefault((stage, c), {})
                if ep > 1:
                    local = {int(m.group(2)) for m in map(_EXPERT.match, names) if m}
                    num_local = max(local) + 1 if local else 0
                    n_all = getattr(ck.args, "num_experts", None)
                    if local and n_all is not None and int(n_all) != num_local * ep:
                        raise CheckpointError(f"{d}: {num_local} local experts per rank x EP {ep}, its args say "
                                              f"--num-experts {n_all}")
                for name in names:
                    expert = _EXPERT.match(name) is not None
                    if ep > 1 and e > 0 and not expert:
                        continue  # replicated across expert-parallel ranks: expert rank 0's copy
                    if any(name not in s[c] for s in shards):
                        raise CheckpointError(f"{d}: {name} is missing from some tensor-parallel ranks of stage "
                                              f"{stage}")
                    t = merge_tp(name, [s[c][name] for s in shards], swiglu, te)
                    target[_with_expert(name, e * num_local) if expert and ep > 1 else name] = t
            if optim is not None:
                stage_opt[stage] = opt_shards
    bar.close()
    assert ck is not None and vp is not None
    # Megatron's interleaved schedule: global layers run chunk 0 of every stage, then chunk 1 of every stage, ...
    # (megatron-core's get_transformer_layer_offset: vp_stage * L / vp + pp_rank * L / (pp * vp) when even)
    offset = 0
    for c in range(vp):
        for stage in range(pp):
            part = chunks[(stage, c)]
            layers = sorted({layer_of(n) for n in part if layer_of(n) is not None})
            if layers != list(range(len(layers))):
                raise CheckpointError(f"{d}: stage {stage} chunk {c} holds layers {layers[:6]} (not 0..n-1)")
            for name, t in part.items():
                local = layer_of(name)
                ck.tensors[with_layer(name, offset + local) if local is not None else name] = t
            if optim is not None and optim.ok and stage in stage_opt:
                optim.merge(stage_opt[stage], bool(getattr(ck.args, "swiglu", False)), offset,
                            _transformer_engine(ck.args))
            offset += len(layers)
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
            out = rank_optimizer_state(sd, sd["model"], self.ck.args, path)
            fix = sd["model"].get(_QKV_FIX)
            if fix is not None:  # a checkpoint_version < 2.0 legacy model's moments: reordered as its weights
                for kind in ("exp_avg", "exp_avg_sq", "main"):
                    for name in out[kind]:
                        if name.endswith(("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")):
                            out[kind][name] = fix(out[kind][name])
            return out
        except LegacyOptimizerRefused as e:
            return self._refuse(str(e))
        except (TypeError, ValueError, KeyError, AttributeError) as e:  # a malformed entry: one line, not a trace
            return self._refuse(f"{path}: its optimizer entry is malformed ({type(e).__name__}: {e})"
                                .replace("\n", " ")[:300])

    def _refuse(self, why: str) -> None:
        self.ok = False
        self.ck.left_out.append(f"optimizer state (refused, not guessed: {why})")
        return None

    def merge(self, shards: list[Any], swiglu: bool, offset: int, te: bool = True) -> None:
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
                t = merge_tp(name, [s[kind][name] for s in shards], swiglu, te)
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
