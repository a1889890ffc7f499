"""Adam's state in Megatron-LM's legacy ``torch`` checkpoints (``mp_rank_TT[_PPP]/model_optim_rng.pt``), read
per rank file into canonical names (`rank_optimizer_state`), and the fp16 loss scaler's state of either format
(`grad_scaler_state`).

Megatron-LM saves ``optimizer.state_dict()`` of its non-distributed optimizer in each rank's file:

* ``FP32Optimizer``: torch's optimizer state dict itself, ``{"state": {index: {"exp_avg", "exp_avg_sq",
  "step"}}, "param_groups": [{"params": [index, ...], "wd_mult", "lr_mult", "max_lr", "is_expert_parallel",
  ...}]}``; the indices number the groups' parameters in turn (torch's ``Optimizer.state_dict``);
* ``Float16OptimizerWithFloat16Params`` (``--bf16``, ``--fp16``): ``{"optimizer": <that>, "grad_scaler":
  {"scale", "growth_tracker", "hysteresis_tracker"} (fp16; ``{}`` for a constant scale), "fp32_from_fp16_params":
  [[fp32 main param of each 16-bit parameter of the group, in order], ...]}``;
* a ``ChainedOptimizer`` of several (a mixture-of-experts model's expert parameters): a list of those, each
  numbering its own parameters from 0.

The parameter an index stands for is not stored; it is recovered as megatron-core builds the groups
(``_get_param_groups``): the rank's parameters in ``model.parameters()`` order, which is the order of its saved
``model`` state dict (torch walks the modules in registration order for both; buffers and ``_extra_state``
left out), each in the group whose attributes match its own: ``wd_mult`` 0 for biases and 1-dim
parameters, the ``--decoupled-lr`` group for the embedding and output weights, ``is_expert_parallel``
for routed experts. Every group's size and every moment's shape is checked against the weights; whatever does
not fit exactly is refused (a note; the optimizer starts fresh) rather than guessed. Not read: the
distributed optimizer's legacy per-DP-rank ``distrib_optim.pt`` files (its ``model_optim_rng.pt`` keeps
only the param groups), optimizers other than Adam.
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain.convert.megatron.names import canonical_name

__all__ = ["RankOptimizerState", "rank_optimizer_state", "grad_scaler_state", "LegacyOptimizerRefused",
           "megatron_param_order", "module_order", "legacy_optimizer_entry", "group_templates", "megatron_grad_scaler"]

_BUFFERS = ("_extra_state", ".expert_bias", ".local_tokens_per_expert")
_EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")
_SCALER_KEYS = ("scale", "growth_tracker", "hysteresis_tracker")


class LegacyOptimizerRefused(ValueError):
    """The legacy optimizer state of one rank file does not map onto its parameters exactly (the reason, one line)."""


class RankOptimizerState(dict):
    """One rank file's Adam state: ``exp_avg`` / ``exp_avg_sq`` / ``main`` (canonical local names -> tensors),
    and the ``step``."""


def megatron_param_order(model: dict[str, Any]) -> list[str]:
    """The saved ``model`` state dict's keys of this rank's parameters, in megatron-core's ``model.parameters()``
    order (the state dict's own; buffers and ``_extra_state`` entries left out)."""
    return [k for k, v in model.items() if isinstance(v, torch.Tensor) and not k.endswith(_BUFFERS)
            and canonical_name(k) is not None]


def _param_signature(key: str, t: torch.Tensor, args: Any) -> tuple[bool, bool, bool]:
    """(no weight decay, decoupled lr, expert-parallel) of one parameter, as megatron-core's param groups split them."""
    if getattr(args, "apply_wd_to_qk_layernorm", False):
        no_wd = (t.dim() == 1 or key.endswith(".bias")) and not ("q_layernorm." in key or "k_layernorm." in key)
    else:
        no_wd = t.dim() == 1 or key.endswith(".bias")
    decoupled = getattr(args, "decoupled_lr", None) is not None and key.endswith(_EMBEDDING_OR_OUTPUT)
    return no_wd, decoupled, ".mlp.experts." in key


def _group_signature(g: dict[str, Any], args: Any, where: str) -> tuple[bool, bool, bool]:
    if "wd_mult" not in g:
        raise LegacyOptimizerRefused(f"{where}: its param groups carry no wd_mult (an older Megatron-LM): "
                                     "which parameters a group holds cannot be told")
    if float(g.get("lr_mult", 1.0)) != 1.0:
        raise LegacyOptimizerRefused(f"{where}: a param group with lr_mult {g['lr_mult']}: which parameters it "
                                     "holds cannot be told")
    decoupled_lr = getattr(args, "decoupled_lr", None)
    decoupled = bool(g.get("is_decoupled_lr")) or (
        decoupled_lr is not None and g.get("max_lr") == decoupled_lr and decoupled_lr != getattr(args, "lr", None))
    return float(g["wd_mult"]) == 0.0, decoupled, bool(g.get("is_expert_parallel", False))


def _split(entry: Any, where: str) -> list[tuple[dict[str, Any], list[list[torch.Tensor]] | None]]:
    """(torch optimizer state dict, fp32 main params by group or None) of each (chained) optimizer."""
    subs = entry if isinstance(entry, list) else [entry]
    out = []
    for sub in subs:
        if not isinstance(sub, dict):
            raise LegacyOptimizerRefused(f"{where}: its optimizer entry is a {type(sub).__name__}, not a state dict")
        inner = sub.get("optimizer") if "optimizer" in sub else sub
        if not isinstance(inner, dict) or "param_groups" not in inner:
            raise LegacyOptimizerRefused(f"{where}: its optimizer entry holds no param_groups")
        groups = inner["param_groups"]
        if "state" not in inner or any(isinstance(g, dict) and "params" not in g for g in groups):
            raise LegacyOptimizerRefused(f"{where}: holds the distributed optimizer's param groups only (its "
                                         "moments are in the DP ranks' distrib_optim.pt, by bucket; re-save as "
                                         "torch_dist with --dist-ckpt-optim-fully-reshardable)")
        mains = sub.get("fp32_from_fp16_params", sub.get("fp32_from_fp16")) if "optimizer" in sub else None
        indices = [i for g in groups for i in g["params"]] if all(
            isinstance(g, dict) and isinstance(g["params"], list) for g in groups) else None
        if not isinstance(inner["state"], dict) or indices is None or len(set(indices)) != len(indices) or (
                mains is not None and not (isinstance(mains, list) and all(isinstance(m, list) for m in mains))):
            raise LegacyOptimizerRefused(f"{where}: its optimizer entry is not a torch optimizer state dict (param "
                                         "groups of distinct parameter indices)")
        out.append((inner, mains))
    return out


def rank_optimizer_state(sd: dict[str, Any], model: dict[str, Any], args: Any, where: str) -> RankOptimizerState:
    """The Adam state in one legacy rank file ``sd`` (its ``model`` entry ``model``), by canonical local name;
    raises `LegacyOptimizerRefused` where it does not map exactly."""
    order = megatron_param_order(model)
    sig = {k: _param_signature(k, model[k], args) for k in order}
    taken: set[str] = set()
    out = RankOptimizerState(exp_avg={}, exp_avg_sq={}, main={}, step=None)
    steps: set[int] = set()
    with_mains = False
    for inner, mains in _split(sd["optimizer"], where):
        with_mains = with_mains or mains is not None
        state = inner["state"]
        groups = inner["param_groups"]
        signatures = [_group_signature(g, args, where) for g in groups]
        if len(set(signatures)) != len(signatures):
            raise LegacyOptimizerRefused(f"{where}: two param groups of the same kind: which parameters each holds "
                                         "cannot be told")
        if mains is not None and len(mains) != len(groups):
            raise LegacyOptimizerRefused(f"{where}: fp32_from_fp16_params has {len(mains)} groups, the optimizer "
                                         f"{len(groups)}")
        for gi, (g, s) in enumerate(zip(groups, signatures)):
            members = [k for k in order if sig[k] == s and k not in taken]
            if len(members) != len(g["params"]):
                raise LegacyOptimizerRefused(f"{where}: param group {gi} holds {len(g['params'])} parameters, the "
                                             f"model {len(members)} of its kind (wd_mult {g['wd_mult']})")
            taken.update(members)
            sixteen = [k for k in members if model[k].dtype in (torch.float16, torch.bfloat16)]
            if mains is not None and len(mains[gi]) != len(sixteen):
                raise LegacyOptimizerRefused(f"{where}: fp32_from_fp16_params group {gi} holds {len(mains[gi])} "
                                             f"tensors, the group {len(sixteen)} 16-bit parameters")
            if mains is not None:
                for k, t in zip(sixteen, mains[gi]):
                    _check_shape(where, "fp32_from_fp16_params", k, t, model[k])
                    out["main"][canonical_name(k)] = t.float()
            for index, k in zip(g["params"], members):
                st = state.get(index)
                if not isinstance(st, dict) or any(m not in st for m in ("exp_avg", "exp_avg_sq")):
                    raise LegacyOptimizerRefused(f"{where}: no Adam moments for parameter {index} ({k})")
                for m in ("exp_avg", "exp_avg_sq"):
                    _check_shape(where, m, k, st[m], model[k])
                    out[m][canonical_name(k)] = st[m]
                step = st.get("step", g.get("step"))
                if step is not None:
                    steps.add(int(float(step)))
    left = [k for k in order if k not in taken]
    if left:
        raise LegacyOptimizerRefused(f"{where}: no param group holds {left[0]}")
    if len(steps) > 1:
        raise LegacyOptimizerRefused(f"{where}: its parameters have different steps {sorted(steps)[:4]}")
    out["step"] = steps.pop() if steps else None
    if with_mains and len(out["main"]) != len(order):
        out["main"] = {}  # some parameters kept in fp32 by the model itself: the weights serve as main params
    return out


def _check_shape(where: str, kind: str, key: str, t: Any, weight: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(weight.shape):
        shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise LegacyOptimizerRefused(f"{where}: {kind} of {key} (by megatron-core's parameter order) has shape "
                                     f"{shape}, the weight {list(weight.shape)}: the order does not fit")


def grad_scaler_state(entry: Any) -> dict[str, Any] | None:
    """The fp16 dynamic loss scaler's state in a checkpoint's ``optimizer`` entry (legacy or ``common.pt``):
    ``{"scale": float, "growth_tracker": int, "hysteresis_tracker": int}``, or None (no scaler, or a constant one)."""
    found: list[dict[str, Any]] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            gs = o.get("grad_scaler")
            if isinstance(gs, dict) and all(k in gs for k in _SCALER_KEYS):
                found.append(gs)
            for k, v in o.items():
                if k not in ("state", "grad_scaler"):
                    walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
    walk(entry)
    if not found:
        return None
    gs = found[0]
    scale = gs["scale"]
    scale = float(scale.reshape(-1)[0].item()) if isinstance(scale, torch.Tensor) else float(scale)
    return {"scale": scale, "growth_tracker": int(gs["growth_tracker"]),
            "hysteresis_tracker": int(gs["hysteresis_tracker"])}


# megatron-core's GPTModel registers a layer's modules in this order (its Attention builds linear_proj before
# SelfAttention adds linear_qkv); Transformer Engine's LayerNormLinear its layer_norm_weight/bias before weight/bias
_LAYER_ORDER = [f"{m}.{p}" for m, ps in (
    ("input_layernorm", ("weight", "bias")), ("self_attention.linear_proj", ("weight", "bias")),
    # multi-latent attention registers its projections after linear_proj, its latent norms last (under
    # Transformer Engine names they are the up-projections' layer_norm_weight)
    ("self_attention.linear_q_proj", ("weight",)), ("self_attention.linear_q_down_proj", ("weight",)),
    ("self_attention.linear_q_up_proj", ("layer_norm_weight", "weight")),
    ("self_attention.linear_kv_down_proj", ("weight",)),
    ("self_attention.linear_kv_up_proj", ("layer_norm_weight", "weight")),
    ("self_attention.linear_qkv", ("layer_norm_weight", "layer_norm_bias", "weight", "bias")),
    ("self_attention.q_layernorm", ("weight", "bias")), ("self_attention.k_layernorm", ("weight", "bias")),
    ("self_attention.kv_layernorm", ("weight",)),
    ("pre_mlp_layernorm", ("weight", "bias")), ("mlp.linear_fc1", ("layer_norm_weight", "layer_norm_bias", "weight",
                                                                   "bias")),
    ("mlp.linear_fc2", ("weight", "bias"))) for p in ps]
_TOP_ORDER = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight", None,
              "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"]


def module_order(names: list[str]) -> list[str] | None:
    """One rank file's parameter names (dense GPT, MLA too; local or TE names) in megatron-core's ``model.parameters()``
    order; None when one is not a dense GPT model's (its place in that order is not known here)."""
    keys = []
    for name in names:
        if name.startswith("decoder.layers."):
            layer, rest = name[len("decoder.layers."):].split(".", 1)
            if rest not in _LAYER_ORDER:
                return None
            keys.append((2, int(layer), _LAYER_ORDER.index(rest), name))
        elif name in _TOP_ORDER:
            i = _TOP_ORDER.index(name)
            keys.append((i if i < 2 else i + 1, 0, 0, name))
        else:
            return None
    return [k[-1] for k in sorted(keys)]


def group_templates(groups: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[bool, dict[str, Any]] | str:
    """megatrain's param groups as Megatron's two (keyed by "no weight decay"), or why they are not those two."""
    out: dict[bool, dict[str, Any]] = {}
    for g in groups:
        if g.get("is_decoupled_lr") or float(g.get("lr_mult", 1.0)) != 1.0 or g.get("is_expert_parallel"):
            return "a param group with its own learning rate (--decoupled-lr) or experts"
        entry = {k: g[k] for k in keys if k in g}
        entry.update(wd_mult=float(g.get("wd_mult", 1.0)), lr_mult=1.0, is_expert_parallel=False,
                     is_decoupled_lr=False)
        if isinstance(entry.get("betas"), list):
            entry["betas"] = tuple(entry["betas"])
        out.setdefault(entry["wd_mult"] == 0.0, entry)
    for no_wd in (False, True):
        out.setdefault(no_wd, {**next(iter(out.values()), {}), "wd_mult": 0.0 if no_wd else 1.0})
    return out


def legacy_optimizer_entry(model: dict[str, Any], moments: dict[str, dict[str, torch.Tensor]], step: int,
                           templates: dict[bool, dict[str, Any]], args: Any, mains: dict[str, torch.Tensor] | None,
                           grad_scaler: dict[str, Any] | None) -> dict[str, Any]:
    """One rank file's ``optimizer`` entry as megatron-core's non-distributed optimizer saves it: torch's
    state dict by index over its param groups (weight decay first, then none, as ``_get_param_groups`` orders
    them), ``model``'s keys in megatron-core's parameter order; with ``mains`` (fp32 main params of 16-bit
    weights) ``Float16OptimizerWithFloat16Params``'s ``{"optimizer", "grad_scaler", "fp32_from_fp16_params"}``."""
    order = megatron_param_order(model)
    state: dict[int, dict[str, torch.Tensor]] = {}
    groups, main_groups = [], []
    for no_wd in (False, True):
        members = [k for k in order if _param_signature(k, model[k], args)[0] == no_wd]
        first = len(state)
        for i, k in enumerate(members):
            state[first + i] = {"step": torch.tensor(float(step)),
                                **{m: moments[m][k].float().contiguous().clone() for m in ("exp_avg", "exp_avg_sq")}}
        groups.append({**templates[no_wd], "params": list(range(first, first + len(members)))})
        if mains is not None:
            main_groups.append([mains[k].float().contiguous().clone() for k in members])
    inner = {"state": state, "param_groups": groups}
    if mains is None:
        return inner
    out: dict[str, Any] = {"optimizer": inner}
    if grad_scaler is not None:
        out["grad_scaler"] = megatron_grad_scaler(grad_scaler)
    out["fp32_from_fp16_params"] = main_groups
    return out


def megatron_grad_scaler(state: dict[str, Any]) -> dict[str, Any]:
    """megatron-core's ``DynamicGradScaler.state_dict()`` of megatrain's dynamic loss scaler state (the scale a
    one-element fp32 tensor, as megatron-core keeps it)."""
    return {"scale": torch.tensor([float(state["scale"])], dtype=torch.float32),
            "growth_tracker": int(state["growth_tracker"]), "hysteresis_tracker": int(state["hysteresis_tracker"])}
