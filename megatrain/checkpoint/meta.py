"""``meta.json``: the plain-JSON description of a checkpoint, the format versions, and the reader
that gives a checkpoint of any earlier format the fields of the current one.

Formats (``format_version`` in ``meta.json``):

1. DCP shards and ``meta.json`` (no completeness markers);
2. per-rank completeness markers with the files' sizes;
3. the markers hold the files' block checksums too;
4. ``meta.json`` names the model family (``"family": "gpt"``) next to its ``model_config``.

`read_meta` returns the fields of format 4 whatever the file's version: a checkpoint written
before the family was recorded holds a model of `DEFAULT_FAMILY` ("gpt", the only family
megatrain had). ``format_version`` stays the file's, so the markers are checked by its rules.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from typing import Any

import torch

from megatrain.checkpoint.errors import CheckpointError
from megatrain.checkpoint.ranks import world
from megatrain.checkpoint.state import TrainState
from megatrain.json_input import parse_json
from megatrain.models.registry import DEFAULT_FAMILY, family_of_config, get_family

__all__ = ["FORMAT_VERSION", "META", "read_meta", "format_problem", "build_meta", "checkpoint_family",
           "checkpoint_model_config"]

FORMAT_VERSION = 4
FAMILY_SINCE = 4  # the first format that records the model family
META = "meta.json"


def read_meta(ckpt: str) -> dict[str, Any]:
    """``ckpt``'s ``meta.json`` with the fields of the current format (ValueError naming the file
    when it is not a JSON object or its family is not a name)."""
    path = os.path.join(ckpt, META)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        meta = parse_json(raw)
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: must hold a JSON object, not {type(meta).__name__}")
    version = meta.get("format_version", 1)
    if isinstance(version, int) and version < FAMILY_SINCE:
        meta["family"] = DEFAULT_FAMILY
    elif "family" in meta and not (isinstance(meta["family"], str) and meta["family"]):
        raise ValueError(f"{path}: 'family' must name a model family, not {meta['family']!r}")
    return meta


def format_problem(meta: dict[str, Any]) -> str | None:
    """Why ``meta``'s format fields make the checkpoint unreadable here, or None."""
    version, world_size = meta.get("format_version", 1), meta.get("world_size", 1)
    if not isinstance(version, int) or not isinstance(world_size, int) or world_size < 1:
        return f"{META} is damaged (format_version {version!r}, world_size {world_size!r})"
    if version > FORMAT_VERSION:
        return (f"written by a newer megatrain (checkpoint format {version}; this one reads formats up to "
                f"{FORMAT_VERSION})")
    if version >= FAMILY_SINCE and "family" not in meta:
        return f"{META} is damaged (format {version} names the model family; it has none)"
    return None


def checkpoint_family(meta: dict[str, Any]) -> str:
    """The name of the model family whose model ``meta``'s checkpoint holds."""
    return str(meta.get("family", DEFAULT_FAMILY))


def checkpoint_model_config(ckpt: str, meta: dict[str, Any]) -> Any:
    """The model config ``ckpt`` was saved with, as its family's config class (inference and
    exporters build the model from it). CheckpointError when it names an unknown family or holds
    no usable config."""
    try:
        family = get_family(checkpoint_family(meta))
    except ValueError as e:
        raise CheckpointError(f"checkpoint {ckpt}: {e}") from None
    saved = meta.get("model_config")
    if not isinstance(saved, dict) or not saved:
        raise CheckpointError(f"checkpoint {ckpt}: {META} has no model_config")
    try:
        return family.config_class(**saved)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: {META} holds an unusable model_config ({e})") from None


def _jsonable_args(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for k, v in vars(args).items():
        try:
            json.dumps(v)
            out[k] = v
        except TypeError:
            out[k] = repr(v)
    return out


def _layout(args: argparse.Namespace) -> dict[str, Any]:
    world_size = world()
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    return {"world_size": world_size, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "context_parallel_size": cp, "data_parallel_size": world_size // (tp * pp * cp),
            "zero_stage": int(getattr(args, "zero_stage", 0) or 0),
            "sequence_parallel": bool(getattr(args, "sequence_parallel", False))}


def _plain(obj: Any) -> Any:
    """A JSON round trip: a frozen copy of plain data (scheduler and scaler states)."""
    return json.loads(json.dumps(obj))


def build_meta(state: TrainState, model_config: Any, args: argparse.Namespace, extra_state: dict[str, Any], *,
               has_optimizer: bool, has_rng: bool) -> dict[str, Any]:
    """The ``meta.json`` content of a checkpoint being saved (format `FORMAT_VERSION`)."""
    return {"format_version": FORMAT_VERSION, "train_state": asdict(state),
            "family": family_of_config(model_config).name, "model_config": asdict(model_config),
            "has_optimizer": has_optimizer, "has_rng": has_rng, "world_size": world(), "layout": _layout(args),
            "args": _jsonable_args(args), "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "torch_version": torch.__version__, **_plain(extra_state)}
