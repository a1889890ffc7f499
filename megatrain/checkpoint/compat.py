"""Whether a checkpoint's model is the one the flags build: the same model family, then each
config field compared by the family's table (``ModelFamily.config_checks``, one `ConfigCheck`
per field; see `megatrain.models.common.config_checks`).

The table is the family's data; the rules here name no field. A field the checkpoint does not
record counts as its default in the family's config class (the behaviour before it existed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, asdict, fields
from typing import Any, Iterator

from megatrain.checkpoint.meta import checkpoint_family
from megatrain.models.common.config_checks import ConfigCheck
from megatrain.models.registry import family_of_config

__all__ = ["family_problem", "config_differences", "config_warnings"]


def family_problem(ckpt: str, meta: dict[str, Any], current: Any) -> str | None:
    """One line when ``ckpt`` (its ``meta``) holds a model of another family than ``current``'s config, or None."""
    saved, run = checkpoint_family(meta), family_of_config(current).name
    if saved == run:
        return None
    return (f"checkpoint {ckpt} holds a model of the family {saved!r} and the flags build one of the family "
            f"{run!r} (a checkpoint loads only into a model of its own family)")


def _defaults(config_class: type) -> dict[str, Any]:
    out = {}
    for f in fields(config_class):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def _differing(saved: dict[str, Any], current: Any, how: str, checks: Mapping[str, ConfigCheck] | None,
               config_class: type | None) -> Iterator[tuple[ConfigCheck, Any, Any]]:
    """(check, checkpoint value, flags value) of each field of kind ``how`` whose values differ."""
    if not saved:  # a checkpoint that records no model config
        return
    if checks is None or config_class is None:
        family = family_of_config(current)
        checks = family.config_checks if checks is None else checks
        config_class = family.config_class if config_class is None else config_class
    defaults = _defaults(config_class)
    cur = asdict(current)

    def compared(check: ConfigCheck) -> bool:
        if check.when is None:
            return True
        name, value = check.when
        return saved.get(name, defaults.get(name)) == value and cur.get(name) == value

    for name, check in checks.items():
        if check.how != how or name not in cur or not compared(check):
            continue
        ours, theirs = cur[name], saved.get(name, defaults.get(name))
        if isinstance(ours, tuple) and isinstance(theirs, list):  # meta.json has no tuples
            theirs = tuple(theirs)
        if isinstance(ours, dict) and isinstance(theirs, dict):  # a sub-config, as meta.json holds it:
            ours = json.loads(json.dumps(ours))  # compared whole, named by the fields that differ
            keys = [k for k in sorted(set(ours) | set(theirs)) if k in ours and theirs.get(k, ours[k]) != ours[k]]
            theirs, ours = {k: theirs[k] for k in keys}, {k: ours[k] for k in keys}
        if (theirs is not None or check.none_is_value) and theirs != ours:
            yield check, theirs, ours


def config_differences(saved: dict[str, Any], current: Any, checks: Mapping[str, ConfigCheck] | None = None,
                       config_class: type | None = None) -> list[str]:
    """One line per ``"compare"`` field that the checkpoint's config (``saved``, from its
    meta.json) and ``current`` (the flags' config) disagree on, naming the flag and both values.

    ``checks`` and ``config_class`` default to those of ``current``'s family in the registry.
    """
    out = []
    for check, theirs, ours in _differing(saved, current, "compare", checks, config_class):
        if isinstance(ours, bool):
            given = ["with" if v != check.inverted else "without" for v in (theirs, ours)]
            line = f"{check.flag}: checkpoint {given[0]}, flags {given[1]}"
        else:
            line = f"{check.flag}: checkpoint {theirs}, flags {ours}"
        out.append(line + (f" ({check.note})" if check.note else ""))
    return out


def config_warnings(ckpt: str, saved: dict[str, Any], current: Any, checks: Mapping[str, ConfigCheck] | None = None,
                    config_class: type | None = None) -> list[str]:
    """One warning per ``"warn"`` field on which ``ckpt``'s config and ``current`` disagree."""
    out = []
    for check, theirs, ours in _differing(saved, current, "warn", checks, config_class):
        def words(v: Any) -> str:
            return check.values.get(str(v), f"{check.flag} {v}")
        out.append(f"checkpoint {ckpt} was trained with {words(theirs)} and the flags give {words(ours)}"
                   + (f" ({check.note})" if check.note else ""))
    return out
