"""Model conversion one group of tensors (a layer) at a time, for the HF import and export.

Both directions are written as one mapping of a whole state dict (an adapter's ``from_hf_state_dict``
/ ``to_hf_state_dict``); `StreamingConversion` runs that mapping once per group with only the group's
tensors real, so a converter holds about one layer besides what it is writing.
"""

from __future__ import annotations

import re
from typing import Any

import torch

_GROUP = re.compile(r"^(.*?\.\d+)\.")  # "model.layers.3." -> one layer's tensors; the rest: one group


def tensor_group(name: str) -> str:
    """The conversion group of a tensor name: its prefix up to the first number (a layer, with its
    experts), or "" (embeddings, final norm, output layer). Every family's mapping combines tensors
    of one group only (a layer's q/k/v into linear_qkv), so groups convert independently."""
    m = _GROUP.match(name)
    return m.group(1) if m else ""


class StreamingConversion:
    """Converts a model one group of tensors at a time: ``convert`` (a whole-state-dict mapping such as
    ``from_hf_state_dict``) is run with the group's tensors real and every other one a meta
    placeholder, so its outputs for that group come out real and the rest cost nothing. The same
    operations on the same values: the numbers are those of converting everything at once.

    ``get(name)`` returns one output tensor, converting its group on first use and keeping that
    group's other outputs until they are asked for (in state-dict order, one group at a time)."""

    def __init__(self, shapes: dict[str, tuple[torch.Size, torch.dtype]], read: Any, convert: Any,
                 cast: torch.dtype | None = None) -> None:
        self._shapes, self._read, self._convert, self._cast = shapes, read, convert, cast
        self._groups: dict[str, list[str]] = {}
        for name in shapes:
            self._groups.setdefault(tensor_group(name), []).append(name)
        self._pinned: dict[str, torch.Tensor] = {}  # inputs kept real in every pass
        try:  # every output as a meta tensor (raises on missing / unexpected tensors)
            self.outputs = self._run(None)
        except (NotImplementedError, RuntimeError):  # a mapping that looks at values (BERT's token types,
            self._pin([""])                           # T5's tied embedding copies): the global tensors real
            try:
                self.outputs = self._run(None)
            except (NotImplementedError, RuntimeError):
                self._pin(list(self._groups))  # all real: the whole model at once, as unstreamed
                self.outputs = self._run(None)
        self._owner: dict[str, str] = {}
        for group in self._groups:  # which group makes each output: the outputs that come out real
            try:
                out = self._run(group, stand_in=True)
            except RuntimeError:  # an operation the zero stand-ins do not take: the real tensors then
                out = self._run(group)
            for name, t in out.items():
                if not t.is_meta:
                    self._owner.setdefault(name, group)
            del out
        self._cache: dict[str, torch.Tensor] = {}

    def _pin(self, groups: list[str]) -> None:
        for g in groups:
            for name in self._groups.get(g, []):
                if name not in self._pinned:
                    t = self._read(name)
                    self._pinned[name] = t.to(self._cast) if self._cast is not None else t

    def _placeholder(self, name: str) -> torch.Tensor:
        shape, dtype = self._shapes[name]
        return torch.empty(shape, dtype=self._cast or dtype, device="meta")

    def _run(self, group: str | None, stand_in: bool = False) -> dict[str, torch.Tensor]:
        """``convert`` with ``group``'s tensors real (read, or with ``stand_in`` a zero broadcast to the
        shape, which holds no memory) and all others meta."""
        inputs: dict[str, torch.Tensor] = {}
        for g, names in self._groups.items():
            for name in names:
                if name in self._pinned:
                    inputs[name] = self._pinned[name]
                elif g != group:
                    inputs[name] = self._placeholder(name)
                elif stand_in:
                    shape, dtype = self._shapes[name]
                    inputs[name] = torch.zeros((), dtype=self._cast or dtype).expand(shape)
                else:
                    t = self._read(name)
                    inputs[name] = t.to(self._cast) if self._cast is not None else t
        return self._convert(inputs)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            group = self._owner.get(name)
            if group is None:
                raise KeyError(f"{name}: not made by any group of tensors")
            self._cache = {}
            out = self._run(group)
            self._cache = {k: v for k, v in out.items() if self._owner.get(k) == group}
            del out
        return self._cache.pop(name)
