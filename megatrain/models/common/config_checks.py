"""`ConfigCheck`: how one model-config field is compared between a checkpoint and the flags.

A family gives one per field of its config (``ModelFamily.config_checks``); the checkpoint code
applies them without knowing any field. The decision is data:

* ``how``: ``"compare"`` — a difference changes the model's numbers (or its tensors) and is
  refused (under ``--finetune`` a warning); ``"warn"`` — a difference is a warning;
  ``"no"`` — the value may legitimately differ (regularisation, initialisation, precision).
* ``flag``: the flag named in the message.
* ``when``: ``(field, value)``: compared only when both configs have that value there (a RoPE
  setting only when both use RoPE).
* ``note``: said after the line, in parentheses; ``inverted``: a boolean whose flag means False
  (``--disable-bias-linear``); ``values``: words for values in a warning (``"none"`` ->
  ``"exact GELU"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConfigCheck", "KINDS"]

KINDS = ("compare", "warn", "no")


@dataclass(frozen=True)
class ConfigCheck:
    how: str
    flag: str
    when: tuple[str, Any] | None = None
    note: str = ""
    inverted: bool = False
    values: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.how in KINDS, self.how
