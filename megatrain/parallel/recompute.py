"""Activation recomputation (Megatron's ``--recompute-*`` flags) with torch's non-reentrant checkpointing.

* ``--recompute-granularity full --recompute-method block --recompute-num-layers N``: the first N
  transformer layers of the stage are checkpointed (only their inputs are kept; the layer is run
  again in the backward pass); the others keep all activations.
* ``--recompute-granularity full --recompute-method uniform --recompute-num-layers N``: Megatron
  checkpoints chunks of N consecutive layers (one stored input per chunk). Here every layer is
  checkpointed on its own: the same numbers and the same recompute work, with one stored input per
  layer instead of per chunk (N = 1, the common setting and what ``--checkpoint-activations``
  means, is exactly Megatron's).
* ``--recompute-granularity selective``: only core attention (softmax(QK^T)V with its dropout,
  ``self_attention.core_attention``, and ``cross_attention.core_attention`` where a layer has
  one) is recomputed, Megatron's "selective" choice: cheap to redo, large to keep.
* ``--recompute-granularity selective --recompute-modules M ...`` (Megatron's list; default ``core_attn``):
  ``core_attn`` as above; ``mlp`` the dense layers' MLP (fc1, activation, fc2: only its input is kept);
  ``moe`` the mixture-of-experts layers' whole ``mlp`` (below); ``shared_experts`` a MoE layer's shared
  experts. Megatron's ``layernorm``, ``moe_act`` and ``mla_up_proj`` are accepted and change nothing (a
  note says so at start-up): each drops an output that the next operation here saves anyway (a norm's
  output is the following matmul's saved input), so recomputing it would save no memory; ``mlp`` or
  ``moe`` recompute the whole block instead. The numbers are the same either way.
* Transformer layers a model keeps outside its stacks (GPT's multi-token prediction depths) are recomputed
  as the stacks' are; under ``full`` all of them whatever the method (Megatron's MTP layers check the
  granularity only).
* ``--moe-layer-recompute``: the mixture-of-experts layers' ``mlp`` (router, token dispatch, experts,
  shared experts) is recomputed, Megatron's ``moe_layer_recompute`` (its ``--recompute-modules moe``);
  it combines with ``selective`` (not with ``full``, which already recomputes whole layers). Under
  expert parallelism the recomputation repeats the dispatch collectives, in the same order on every rank.

Wrapping uses torch's ``checkpoint_wrapper``; the wrapper's ``_checkpoint_wrapped_module`` path
part is dropped from parameter names by DCP and by ``canonical_parameter_name``. RNG state is
preserved and restored, so dropout masks replay exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from megatrain.models.common.layer_stacks import layer_stacks
from megatrain.parallel.expert_parallel import moe_layers


SELECTIVE_MODULES = ("core_attn", "mlp", "moe", "shared_experts")
# Megatron's modules whose recomputation would save nothing here: accepted, with the reason as a note
NO_OP_MODULES = {
    "layernorm": "the norm's output is the next matmul's saved input here, so dropping it would save nothing "
                 "(mlp or moe recompute whole blocks)",
    "moe_act": "the experts' activation output is fc2's saved input here, so dropping it would save nothing "
               "(moe recomputes the whole MoE block)",
    "mla_up_proj": "the up-projections' outputs are the attention's saved inputs here, so dropping them would "
                   "save nothing",
}


@dataclass
class RecomputeConfig:
    granularity: str | None = None  # None, "full" or "selective"
    method: str | None = None  # "uniform" or "block" (full only)
    num_layers: int | None = None
    moe_layer: bool = False  # --moe-layer-recompute: the MoE layers' mlp
    modules: tuple[str, ...] | None = None  # --recompute-modules (selective only; default core_attn)

    def __post_init__(self) -> None:
        if self.granularity not in (None, "full", "selective"):
            raise ValueError(f"--recompute-granularity must be full or selective, got {self.granularity!r}")
        if self.granularity == "selective":
            self.modules = tuple(self.modules) if self.modules is not None else ("core_attn",)
            for name in self.modules:
                if name not in SELECTIVE_MODULES and name not in NO_OP_MODULES:
                    raise ValueError(f"--recompute-modules {name}: not a module megatrain recomputes (choose from "
                                     f"{', '.join((*SELECTIVE_MODULES, *NO_OP_MODULES))})")
            if "moe" in self.modules:
                self.moe_layer = True
        else:
            self.modules = ()
        if self.moe_layer and self.granularity == "full":
            raise ValueError("--moe-layer-recompute with --recompute-granularity full: full recomputation already "
                             "recomputes whole layers; give one of them (as Megatron-LM refuses both)")
        if self.granularity == "full":
            self.method = self.method or "uniform"
            if self.method not in ("uniform", "block"):
                raise ValueError(f"--recompute-method must be uniform or block, got {self.method!r}")
            if self.num_layers is None:
                self.num_layers = 1
            if self.num_layers < 1 and self.method == "uniform":
                raise ValueError(f"--recompute-num-layers must be at least 1, got {self.num_layers}")
            if self.num_layers < 0:
                raise ValueError(f"--recompute-num-layers must not be negative, got {self.num_layers}")


def _wrap(module: nn.Module) -> nn.Module:
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True)


def apply_activation_checkpointing(model: nn.Module, cfg: RecomputeConfig) -> list[str]:
    """Wrap the layers (or core attentions) of ``model`` as ``cfg`` asks; returns the wrapped paths.

    A model with several stacks of layers (an encoder-decoder) has them handled stack by stack: with
    ``--recompute-method block`` the first N layers of each stack, as Megatron's blocks do."""
    wrapped: list[str] = []
    modules = cfg.modules or ()
    stacks = layer_stacks(model)
    extra = _extra_layer_slots(model)
    every = [(f"{prefix}.{key}", layer) for prefix, layers in stacks.items() for key, layer in layers.items()]
    every += [(path, getattr(parent, attr)) for path, parent, attr in extra]
    for path, layer in every:
        mlp = getattr(layer, "mlp", None)
        is_moe = mlp is not None and any(m is mlp for m in moe_layers(layer))
        if is_moe and cfg.moe_layer:
            layer.mlp = _wrap(mlp)
            wrapped.append(f"{path}.mlp")
        elif is_moe and "shared_experts" in modules and getattr(mlp, "shared_experts", None) is not None:
            mlp.shared_experts = _wrap(mlp.shared_experts)
            wrapped.append(f"{path}.mlp.shared_experts")
        elif mlp is not None and not is_moe and "mlp" in modules:
            layer.mlp = _wrap(mlp)
            wrapped.append(f"{path}.mlp")
    if cfg.granularity is None:
        return wrapped
    if cfg.granularity == "full":
        assert cfg.num_layers is not None
        for prefix, layers in stacks.items():
            keys = list(layers.keys())
            for key in keys[: cfg.num_layers] if cfg.method == "block" else keys:
                layers[key] = _wrap(layers[key])
                wrapped.append(f"{prefix}.{key}")
        for path, parent, attr in extra:  # as Megatron: whatever the method, full recomputation takes them all
            setattr(parent, attr, _wrap(getattr(parent, attr)))
            wrapped.append(path)
        return wrapped
    for path, layer in every if "core_attn" in modules else ():
        for name in ("self_attention", "cross_attention"):  # core attention of each attention module
            attention = getattr(layer, name, None)
            if attention is not None:
                attention.core_attention = _wrap(attention.core_attention)
                wrapped.append(f"{path}.{name}.core_attention")
    return wrapped


def _extra_layer_slots(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(path, parent module, attribute) of the transformer layers a model keeps outside its stacks (GPT's
    multi-token prediction depths: ``extra_transformer_layer_slots()``)."""
    slots = getattr(model, "extra_transformer_layer_slots", None)
    return list(slots()) if callable(slots) else []
    for prefix, layers in layer_stacks(model).items():
        keys = list(layers.keys())
        if cfg.granularity == "full":
            assert cfg.num_layers is not None
            chosen = keys[: cfg.num_layers] if cfg.method == "block" else keys
            for key in chosen:
                layers[key] = _wrap(layers[key])
                wrapped.append(f"{prefix}.{key}")
            continue
        for key in keys if "core_attn" in modules else ():
            for name in ("self_attention", "cross_attention"):  # core attention of each attention module
                attention = getattr(layers[key], name, None)
                if attention is not None:
                    attention.core_attention = _wrap(attention.core_attention)
                    wrapped.append(f"{prefix}.{key}.{name}.core_attention")
    return wrapped
