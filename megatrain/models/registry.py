"""The model-family registry: one :class:`ModelFamily` per folder under ``megatrain/models/``.

A family is everything the rest of megatrain needs to know about a kind of model, given as plain
callables and data (compare torchtitan's ``ModelSpec`` and Megatron's ``model_provider``):

* ``config_class`` and ``config_from_args``: its typed config, built once from the flags;
* ``build_model`` (the plain single-device model) and ``build_stage`` (one pipeline stage of it,
  with the model's own parameter names);
* ``initial_value``: its layout-independent initialisation rules;
* ``tensor_parallel_plan``: its TP/SP plan by module path;
* ``objective``: what a training batch is and what loss it gives;
* ``flops`` and ``memory``: the formulas of the log line and the start-up memory report
  (``batch_flops``, optional: the log line's FLOPs counted per micro-batch read instead);
* ``config_checks``: how each config field is compared between a checkpoint and the flags;
* ``datasets``: its train/valid/test datasets (None: Megatron's GPT token datasets);
* ``hf``: its Hugging Face adapter (None when it has none);
* ``start_parts``: parts of a fresh model started from their own checkpoints (LLaVA's);
* ``add_flags``, ``flag_defaults``, ``prepare_args`` and ``check_args``: what its script
  (``pretrain_bert.py``) adds to the general pre-training command line, the defaults it changes
  there, how its own flags fill the general ones before the general checks (T5's
  ``--encoder-num-layers`` is ``--num-layers``), and its own checks after them.

The training loop, pipeline, checkpointing, conversion and inference code read a family only
through this object: adding one is writing its folder and one :func:`register` call (see
"Adding a model family" in docs/architecture.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from megatrain.models.common.config_checks import ConfigCheck

__all__ = ["ModelFamily", "register", "get_family", "family_names", "family_of_config", "family_for_hf",
           "DEFAULT_FAMILY"]

DEFAULT_FAMILY = "gpt"  # checkpoints that record no family were written by GPT-only megatrain

# Families that ship with megatrain, imported on first use (registering is a side effect of import).
_BUILTIN = {"gpt": "megatrain.models.gpt.family", "bert": "megatrain.models.bert.family",
            "t5": "megatrain.models.t5.family", "llava": "megatrain.models.llava.family"}


@dataclass(frozen=True)
class ModelFamily:
    name: str
    config_class: type
    config_from_args: Callable[..., Any]  # (args, padded vocab size) -> config
    build_model: Callable[[Any], Any]  # config -> nn.Module (on the current default device)
    build_stage: Callable[..., Any]  # (config, layer ids, *, stage_index, num_stages) -> nn.Module
    initial_value: Callable[..., Any]  # (name, shape, config, seed) -> float32 CPU tensor
    tensor_parallel_plan: Callable[..., Any]  # (model, *, sequence_parallel) -> TensorParallelPlan
    objective: Callable[..., Any]  # (args, tokenizer) -> Objective
    flops: Callable[..., float]  # (config, batch size, seq length) -> FLOPs of one forward+backward
    memory: Callable[..., Any] | None = None  # estimate_memory-like (config, **layout) -> MemoryEstimate
    config_checks: dict[str, ConfigCheck] = field(default_factory=dict)  # field name -> its check
    hf: Any = None
    # (args, tokenizer, num_samples per split) -> (train, valid, test); None: Megatron's GPT datasets
    # (indexed .bin/.idx documents cut into --seq-length + 1 token samples, or --mock-data)
    datasets: Callable[..., Any] | None = None
    add_flags: Callable[[Any], None] | None = None  # (argparse parser) -> None: the family's own flags
    flag_defaults: dict[str, Any] = field(default_factory=dict)  # defaults its script changes (Megatron's)
    # (parsed namespace) -> None, before the general checks: the family's own flags fill the general
    # ones they stand for; ValueError naming a flag
    prepare_args: Callable[[Any], None] | None = None
    check_args: Callable[[Any], None] | None = None  # (validated namespace) -> None; ValueError naming a flag
    description: str = ""
    # (parsed namespace) -> [(flag, submodule path, folder, convert)]: parts of a fresh model started
    # from other checkpoints (LLaVA's language model and vision encoder). ``convert`` None: ``folder``
    # holds a megatrain checkpoint of that part; else (config.json dict, tensors) -> the part's state
    # dict, from a Hugging Face folder. None: no such parts.
    start_parts: Callable[[Any], list] | None = None
    script: str = ""  # its training script when not pretrain_<name>.py (LLaVA's: pretrain_vlm.py)
    # (args, config) -> (a training micro-batch as the loader gives it, on the host) -> its FLOPs: the log
    # line counts what each iteration read (LLaVA's images per sample vary); None: ``flops`` of the batch
    batch_flops: Callable[..., Callable[[Any], float]] | None = None


_REGISTRY: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Add ``family`` (re-registering the same name replaces it: tests define toy families)."""
    _REGISTRY[family.name] = family
    return family


def get_family(name: str) -> ModelFamily:
    """The family called ``name``; ValueError naming the known ones when there is none."""
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in _REGISTRY:
        raise ValueError(f"unknown model family {name!r} (known: {', '.join(family_names())})")
    return _REGISTRY[name]


def family_names() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN))


def family_of_config(config: Any) -> ModelFamily:
    """The family whose ``config_class`` ``config`` is an instance of (the most specific one)."""
    for name in _BUILTIN:
        get_family(name)
    matches = [f for f in _REGISTRY.values() if isinstance(config, f.config_class)]
    if not matches:
        raise ValueError(f"no model family has the config class {type(config).__name__}")
    return max(matches, key=lambda f: len(f.config_class.__mro__))


def family_for_hf(hf_config: dict[str, Any]) -> ModelFamily:
    """The family whose Hugging Face adapter takes ``hf_config`` (config.json); ValueError naming
    every class megatrain converts when none does."""
    families = [get_family(name) for name in family_names()]
    for family in families:
        if family.hf is not None and family.hf.accepts(hf_config):
            return family
    known = [a for f in families if f.hf is not None for a in f.hf.architectures]
    found = hf_config.get("architectures") or hf_config.get("model_type")
    from megatrain.models.common.hf_adapter import UnsupportedModelError
    raise UnsupportedModelError(f"architecture {found!r} is not supported; supported: {', '.join(known)}")
