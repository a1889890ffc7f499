"""Megatron-LM's parameter names and layouts, and how they map to megatrain's GPT model.

Three forms of one model's weights meet here:

* **megatrain's** state dict (``megatrain.models.gpt.GPTModel``): ``layers.N.*``, ``final_layernorm``,
  the fused QKV in Megatron's grouped layout, and SwiGLU's ``linear_fc1`` rows interleaved per
  channel (row 2i gate i, row 2i + 1 up i).
* **canonical Megatron** (`to_megatron` / `from_megatron`): what megatron-core's GPTModel with the
  local layer spec holds under TP=1, PP=1: ``decoder.layers.N.*`` with global layer numbers,
  ``decoder.final_layernorm``, the same grouped QKV rows ([group][its query heads, its key, its
  value] x head dim), SwiGLU's ``linear_fc1`` as [all gate rows; all up rows], no ``_extra_state``.
  Transformer Engine's fused names (``self_attention.linear_qkv.layer_norm_weight`` for
  ``input_layernorm.weight``, ``mlp.linear_fc1.layer_norm_weight`` for ``pre_mlp_layernorm.weight``)
  are folded into the local spec's by `canonical_name`.
* **one tensor-parallel rank's** shard of a canonical tensor (legacy ``torch`` checkpoints):
  `tp_dim` says which dim a tensor is split along (None: replicated); `merge_tp` / `split_tp` join
  and cut shards, giving SwiGLU's ``linear_fc1`` its per-shard [gate_r; up_r] halves. The grouped QKV
  needs nothing special: each rank holds whole query groups, in order.

Multi-latent attention (``--multi-latent-attention``): the local spec's names are megatrain's
(``self_attention.linear_q_down_proj``, ``q_layernorm``, ``linear_q_up_proj``, ``linear_kv_down_proj``,
``kv_layernorm``, ``linear_kv_up_proj``, ``linear_proj``, or ``linear_q_proj`` without --q-lora-rank). Megatron's
Transformer Engine spec (``get_gpt_layer_with_transformer_engine_submodules``, its MLA branch) keeps
``input_layernorm`` a module of its own, makes the up projections ``TELayerNormColumnParallelLinear`` under
--qk-layernorm, so the latent norms are ``self_attention.linear_q_up_proj.layer_norm_weight`` and
``self_attention.linear_kv_up_proj.layer_norm_weight``, and fuses a dense layer's ``pre_mlp_layernorm`` into
``mlp.linear_fc1`` as for other attention (an MoE layer's stays apart): `te_layer_name`. Under tensor
parallelism ``linear_q_proj`` and the up projections are column parallel (split on dim 0, whole heads per
rank), ``linear_proj`` row parallel; the down projections are TE's ``TELinear(parallel_mode="duplicated")``,
replicated, but the local spec's ``ColumnParallelLinear`` (split on dim 0, gathered in the forward): `tp_dim`'s
``te``. Megatron-LM since July 2026 also puts a norm of the hidden input into a TE ``linear_q_proj`` (without
--q-lora-rank, with --qk-layernorm: ``linear_q_proj.layer_norm_weight``), which megatrain's MLA has no place
for, and ``--mla-down-proj-fusion`` keeps one ``linear_qkv_down_proj`` per rank in legacy files (its torch_dist
checkpoints hold the two down projections): both refused.

Mixture-of-experts layers: the router (``mlp.router.weight``, ``expert_bias``) and shared
experts keep their names; the routed experts, ``mlp.experts.local_experts.E.linear_fc*`` (the
grouped-GEMM ``experts.linear_fc1.weightE`` read as those), are stacked into megatrain's
``mlp.experts.linear_fc*.weight`` [E, ...] (and cut back into local experts when writing).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

__all__ = ["canonical_name", "to_megatron", "from_megatron", "tp_dim", "merge_tp", "split_tp",
           "layer_of", "with_layer", "UnsupportedMegatronModel", "te_layer_name", "flatten_state_dict",
           "is_legacy_model",
           "legacy_name", "legacy_qkv_fix"]


class UnsupportedMegatronModel(ValueError):
    """A Megatron checkpoint holding parts megatrain's GPT model has no place for (one line)."""


_TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
             "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
             # multi-latent attention (Megatron's TE spec under --qk-layernorm; --mla-down-proj-fusion's input norm)
             "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
             "self_attention.linear_q_up_proj.layer_norm_bias": "self_attention.q_layernorm.bias",
             "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
             "self_attention.linear_kv_up_proj.layer_norm_bias": "self_attention.kv_layernorm.bias",
             "self_attention.linear_qkv_down_proj.layer_norm_weight": "input_layernorm.weight",
             "self_attention.linear_qkv_down_proj.layer_norm_bias": "input_layernorm.bias"}
_MLA_REFUSED = {
    "self_attention.linear_q_proj.layer_norm_weight": "a norm of the hidden input inside linear_q_proj (Megatron-LM's "
    "TE spec with --qk-layernorm and no --q-lora-rank, since July 2026); megatrain's multi-latent attention has none",
    "self_attention.linear_q_proj.layer_norm_bias": "a norm of the hidden input inside linear_q_proj (Megatron-LM's "
    "TE spec with --qk-layernorm and no --q-lora-rank, since July 2026); megatrain's multi-latent attention has none",
    "self_attention.linear_qkv_down_proj.weight": "--mla-down-proj-fusion's fused down projection in a legacy "
    "file; re-save as torch_dist (which stores linear_q_down_proj and linear_kv_down_proj) or without the fusion",
}
#: megatrain's (local spec) names within a layer -> Megatron's Transformer Engine spec's, multi-latent attention
_TE_MLA = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
           "self_attention.q_layernorm.bias": "self_attention.linear_q_up_proj.layer_norm_bias",
           "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
           "self_attention.kv_layernorm.bias": "self_attention.linear_kv_up_proj.layer_norm_bias",
           "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
           "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}
_TE_ATTENTION = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                 "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
                 "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
                 "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}


def te_layer_name(rest: str, *, mla: bool, moe: bool = False) -> str:
    """Megatron's Transformer Engine spec's name of a layer's ``rest`` (a canonical, local-spec name within
    the layer): the norms fused into the next linear (for multi-latent attention the latent norms into the up
    projections, ``input_layernorm`` apart; an MoE layer's ``pre_mlp_layernorm`` apart when ``moe``)."""
    table = _TE_MLA if mla else _TE_ATTENTION
    if moe and rest.startswith("pre_mlp_layernorm."):
        return rest
    return table.get(rest, rest)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


_GROUPED = re.compile(r"^(.*\.mlp\.experts)\.(linear_fc[12])\.(weight|bias)(\d+)$")


def canonical_name(name: str) -> str | None:
    """``name`` with TE's fused-norm names folded into the local spec's and the grouped-GEMM experts'
    ``experts.linear_fc1.weight3`` as ``experts.local_experts.3.linear_fc1.weight``; None for
    ``_extra_state`` entries (TE's FP8 metadata, None for the local spec), which hold no weights."""
    if name.endswith("_extra_state") or "._extra_state/" in name:
        return None
    g = _GROUPED.match(name)
    if g:
        return f"{g.group(1)}.local_experts.{g.group(4)}.{g.group(2)}.{g.group(3)}"
    m = _LAYER.match(name)
    if m and m.group(2) in _TE_NAMES:
        return f"decoder.layers.{m.group(1)}.{_TE_NAMES[m.group(2)]}"
    rest = m.group(2) if m else (name[len("decoder.layers."):] if name.startswith("decoder.layers.") else None)
    if rest in _MLA_REFUSED:
        raise UnsupportedMegatronModel(f"{name}: {_MLA_REFUSED[rest]}")
    return name


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def with_layer(name: str, layer: int) -> str:
    """``decoder.layers.N.rest`` renumbered to ``layer``."""
    m = _LAYER.match(name)
    assert m, name
    return f"decoder.layers.{layer}.{m.group(2)}"


def _is_fc1(name: str) -> bool:
    return name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias")


def _interleave(gate_up: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """[gate; up] rows along ``dim`` -> rows interleaved per channel (megatrain's SwiGLU layout)."""
    gate, up = gate_up.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def _deinterleave(rows: torch.Tensor) -> torch.Tensor:
    """Rows interleaved per channel -> [gate; up]."""
    return torch.cat([rows[0::2], rows[1::2]], dim=0)


def to_megatron(sd: Mapping[str, torch.Tensor], swiglu: bool) -> dict[str, torch.Tensor]:
    """megatrain's GPT state dict -> canonical Megatron names and layouts."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.startswith("layers."):
            key = "decoder." + name
        elif name.startswith("final_layernorm."):
            key = "decoder." + name
        elif name.startswith(("embedding.", "output_layer.")):
            key = name
        else:
            raise UnsupportedMegatronModel(f"{name}: megatrain tensor with no Megatron GPTModel counterpart")
        e = _OUR_EXPERTS.match(key)
        if e:  # megatrain's stacked [E, ...] routed experts: one Megatron local expert each
            for i in range(t.shape[0]):
                part = t[i]
                out[f"{e.group(1)}.mlp.experts.local_experts.{i}.{e.group(2)}"] = (
                    _deinterleave(part) if swiglu and _is_fc1(key) else part)
            continue
        out[key] = _deinterleave(t) if swiglu and _is_fc1(key) else t
    return out


_OUR_EXPERTS = re.compile(r"^(decoder\.layers\.\d+)\.mlp\.experts\.(linear_fc[12]\.(?:weight|bias))$")


def from_megatron(sd: Mapping[str, torch.Tensor], swiglu: bool) -> dict[str, torch.Tensor]:
    """Canonical Megatron names and layouts -> megatrain's GPT state dict."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for key, t in sd.items():
        e = _LOCAL_EXPERT.match(key)
        if e:  # one expert's MLP: stacked into megatrain's [E, ...] tensors below
            experts.setdefault(f"layers.{e.group(1)}.mlp.experts.{e.group(3)}", {})[int(e.group(2))] = t
            continue
        if key.startswith("decoder.layers.") or key.startswith("decoder.final_layernorm."):
            name = key[len("decoder."):]
        elif key.startswith(("embedding.word_embeddings.", "embedding.position_embeddings.", "output_layer.")):
            name = key
        else:
            raise UnsupportedMegatronModel(f"{key}: a Megatron tensor megatrain's GPT model has no place for")
        out[name] = _interleave(t) if swiglu and _is_fc1(key) else t
    for name, by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise UnsupportedMegatronModel(f"{name}: experts {sorted(by_expert)} (not 0..E-1)")
        stacked = torch.stack([by_expert[i] for i in range(len(by_expert))])
        out[name] = _interleave(stacked, dim=1) if swiglu and _is_fc1(name) else stacked
    return out


_LOCAL_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.*)$")


_COLUMN = ("embedding.word_embeddings.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
           "linear_fc1.weight", "linear_fc1.bias", "output_layer.weight",  # dense, shared and routed experts' fc1
           # multi-latent attention's column-parallel projections (whole heads per rank)
           "self_attention.linear_q_proj.weight", "self_attention.linear_q_up_proj.weight",
           "self_attention.linear_kv_up_proj.weight")
_ROW = ("self_attention.linear_proj.weight", "linear_fc2.weight")
# multi-latent attention's down projections: TE's TELinear(parallel_mode="duplicated") on every rank whole,
# the local spec's ColumnParallelLinear(gather_output=False) split on dim 0
_DOWN = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")


def tp_dim(name: str, te: bool = True) -> int | None:
    """The dim a canonical tensor is split along across tensor-parallel ranks (None: every rank
    holds it whole: norms, the row-parallel biases, learned positions, and with Transformer Engine's
    spec (``te``) multi-latent attention's down projections, which the local spec splits on dim 0)."""
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    if name.endswith(_DOWN):
        return None if te else 0
    return None


def merge_tp(name: str, shards: list[torch.Tensor], swiglu: bool, te: bool = True) -> torch.Tensor:
    """One canonical tensor from its tensor-parallel shards (rank order; ``te``: as `tp_dim`)."""
    dim = tp_dim(name, te)
    if dim is None or len(shards) == 1:
        return shards[0]
    if swiglu and _is_fc1(name):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def split_tp(name: str, t: torch.Tensor, tp: int, swiglu: bool, te: bool = True) -> list[torch.Tensor]:
    """The tensor-parallel shards of one canonical tensor (inverse of `merge_tp`)."""
    dim = tp_dim(name, te)
    if dim is None or tp == 1:
        return [t] * tp
    if t.shape[dim] % tp:
        raise UnsupportedMegatronModel(f"{name}: {t.shape[dim]} rows do not split over "
                                       f"--target-tensor-parallel-size {tp}")
    if swiglu and _is_fc1(name):
        gate, up = t.chunk(2, dim=0)
        return [torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0))]
    return [c.clone() for c in t.chunk(tp, dim=dim)]


# Megatron-LM's pre-core ("legacy", ``--use-legacy-models``) GPT model's names, within one layer, -> megatron-core's
# (older vintages: ``attention`` for ``self_attention``); the embedding, final norm and output weights below
_LEGACY_LAYER = {"input_layernorm": "input_layernorm",
                 "self_attention.query_key_value": "self_attention.linear_qkv",
                 "attention.query_key_value": "self_attention.linear_qkv",
                 "self_attention.dense": "self_attention.linear_proj",
                 "attention.dense": "self_attention.linear_proj",
                 "post_attention_layernorm": "pre_mlp_layernorm",
                 "mlp.dense_h_to_4h": "mlp.linear_fc1",
                 "mlp.dense_4h_to_h": "mlp.linear_fc2"}
_LEGACY_TOP = {"language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
               "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
               "language_model.output_layer.weight": "output_layer.weight",
               # a tied model's last pipeline stage keeps its copy of the embedding so
               "word_embeddings_for_head.weight": "output_layer.weight"}
_LEGACY_BLOCK = re.compile(r"^language_model\.(?:encoder|transformer)\.(.*)$")
_LEGACY_IN_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")


def flatten_state_dict(d: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """A (nested) state dict with dotted keys, in its own order (Megatron-LM's legacy models save
    ``model['language_model']['embedding']['word_embeddings']['weight']`` in some vintages, flat keys in others)."""
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten_state_dict(v, key + "."))
        else:
            out[key] = v
    return out


def is_legacy_model(model: Mapping[str, object]) -> bool:
    """A rank file's ``model`` entry holds Megatron-LM's pre-core GPT model (``language_model``, nested or flat)."""
    return any(isinstance(k, str) and (k == "language_model" or k.startswith("language_model.")) for k in model)


def legacy_name(name: str) -> str | None:
    """megatron-core's name of one (flattened) legacy GPT model key, None for ``_extra_state`` and buffers that hold
    no weights; raises `UnsupportedMegatronModel` for a key with no megatron-core counterpart here."""
    if name.endswith("_extra_state") or name.endswith(".inv_freq"):
        return None
    if name in _LEGACY_TOP:
        return _LEGACY_TOP[name]
    b = _LEGACY_BLOCK.match(name)
    if b:
        rest = b.group(1)
        if rest in ("final_layernorm.weight", "final_layernorm.bias", "final_norm.weight", "final_norm.bias"):
            return "decoder.final_layernorm." + rest.rsplit(".", 1)[1]
        m = _LEGACY_IN_LAYER.match(rest)
        if m and m.group(2) in _LEGACY_LAYER:
            return f"decoder.layers.{m.group(1)}.{_LEGACY_LAYER[m.group(2)]}.{m.group(3)}"
    raise UnsupportedMegatronModel(f"{name}: a legacy (pre-core) Megatron-LM GPT weight with no megatron-core "
                                   "counterpart megatrain maps (token types, pooler, MoE and Transformer Engine "
                                   "layers of legacy models are not converted)")


def legacy_qkv_fix(version: float, heads_per_rank: int, head_dim: int):
    """Megatron-LM's ``fix_query_key_value_ordering`` (megatron/training/checkpointing.py) for one tensor-parallel
    rank's legacy ``query_key_value`` weight or bias: checkpoint_version 0 stores it [3, np, hn, ...], 1.0
    [np, hn, 3, ...]; both become [np, 3, hn, ...] (2.0 and later, megatron-core's MHA layout). None for 2.0+."""
    if version >= 2.0:
        return None
    if version not in (0, 1.0):
        raise UnsupportedMegatronModel(f"checkpoint_version {version}: not one Megatron-LM knows (0, 1.0, 2.0+)")

    def fix(t: torch.Tensor) -> torch.Tensor:
        shape = t.shape
        if shape[0] != 3 * heads_per_rank * head_dim:
            raise UnsupportedMegatronModel(f"a checkpoint_version {version} query_key_value of {shape[0]} rows, not "
                                           f"3 x {heads_per_rank} heads x {head_dim}")
        if version == 0:
            t = t.reshape(3, heads_per_rank, head_dim, *shape[1:]).transpose(0, 1)
        else:
            t = t.reshape(heads_per_rank, head_dim, 3, *shape[1:]).transpose(1, 2)
        return t.contiguous().reshape(shape)
    return fix
