"""The Hugging Face adapter a family gives (``ModelFamily.hf``): its transformers classes, and the
config and weight mappings both ways. ``megatrain.convert`` drives export and import through it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["HFAdapter", "UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """The model (or Hugging Face folder) uses something the other side cannot represent exactly."""


@dataclass(frozen=True)
class HFAdapter:
    architectures: tuple[str, ...]  # the transformers classes it converts
    accepts: Callable[[Mapping[str, Any]], bool]  # whether a Hugging Face config.json is one of them
    architecture: Callable[[Any], str]  # config -> the class to export as (UnsupportedModelError if none)
    config_dict: Callable[..., dict[str, Any]]  # (config, architecture, *, vocab_size, dtype, token ids) -> config.json
    to_hf_state_dict: Callable[..., dict[str, Any]]  # (state, config, architecture, *, vocab_size) -> HF tensors
    config_from_hf: Callable[[Mapping[str, Any], int], tuple[Any, str]]  # (config.json, padded vocab) -> (config, class)
    from_hf_state_dict: Callable[..., dict[str, Any]]  # (HF tensors, config, architecture) -> our state dict
