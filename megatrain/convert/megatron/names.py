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
           "layer_of", "with_layer", "UnsupportedMegatronModel"]


class UnsupportedMegatronModel(ValueError):
    """A Megatron checkpoint holding parts megatrain's GPT model has no place for (one line)."""


_TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
             "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
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
           "linear_fc1.weight", "linear_fc1.bias", "output_layer.weight")  # dense, shared and routed experts' fc1
_ROW = ("self_attention.linear_proj.weight", "linear_fc2.weight")


def tp_dim(name: str) -> int | None:
    """The dim a canonical tensor is split along across tensor-parallel ranks (None: every rank
    holds it whole: norms, the row-parallel biases, learned positions)."""
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def merge_tp(name: str, shards: list[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """One canonical tensor from its tensor-parallel shards (rank order)."""
    dim = tp_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if swiglu and _is_fc1(name):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def split_tp(name: str, t: torch.Tensor, tp: int, swiglu: bool) -> list[torch.Tensor]:
    """The tensor-parallel shards of one canonical tensor (inverse of `merge_tp`)."""
    dim = tp_dim(name)
    if dim is None or tp == 1:
        return [t] * tp
    if t.shape[dim] % tp:
        raise UnsupportedMegatronModel(f"{name}: {t.shape[dim]} rows do not split over "
                                       f"--target-tensor-parallel-size {tp}")
    if swiglu and _is_fc1(name):
        gate, up = t.chunk(2, dim=0)
        return [torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0))]
    return [c.clone() for c in t.chunk(tp, dim=dim)]
