"""Reading Megatron-LM's pickles without running anything they name.

Megatron writes three kinds: the legacy ``model_optim_rng.pt`` and the dist-checkpoint ``common.pt``
(``torch.save`` zip files: tensors, plain containers, an ``argparse.Namespace`` of the run's flags,
Megatron's enums, torch dtypes, the RNG states with numpy arrays, TE's ``_extra_state`` buffers), and
torch DCP's ``.metadata`` of a ``torch_dist`` checkpoint (DCP's metadata classes plus the save plans
megatron-core caches in it as ``all_local_plans``).

The ``.pt`` files go through ``torch.load(weights_only=True)`` with an exact list of extra globals,
each mapped to a harmless stand-in defined here (`MegatronEnum`, `Ignored`) or to
``argparse.Namespace`` (whose state is set as attributes of a plain namespace). Nothing is imported
from Megatron or numpy and no constructor of theirs runs: an enum member becomes a `MegatronEnum`
holding its class name and value, a numpy array (only in RNG states, which megatrain does not use)
an `Ignored`. ``.metadata`` goes through megatrain's own DCP unpickler
(`megatrain.checkpoint.safe_pickle`) with DCP's planner dataclasses added and the cached plans
dropped before the usual structural checks. Anything else is refused: one `CheckpointError` line
naming the file and the global.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint import planner as _dcp_planner

from megatrain.checkpoint import safe_pickle
from megatrain.checkpoint.errors import CheckpointError

__all__ = ["MegatronEnum", "Ignored", "load_megatron_pt", "load_megatron_dcp_metadata", "STAND_INS"]


class MegatronEnum:
    """Stands in for a member of one of Megatron's enums (``ModelType.encoder_or_decoder``): the
    pickle calls the class with the member's value; we keep the value and the class's name."""

    enum_name = "enum"

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"{self.enum_name}({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.value == self.value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.enum_name, repr(self.value)))


def _enum(module: str, name: str) -> tuple[type, str]:
    cls = type(name, (MegatronEnum,), {"enum_name": name, "__module__": __name__})
    return cls, f"{module}.{name}"


class Ignored:
    """Stands in for objects megatrain never uses (numpy RNG arrays and their dtypes, TE's BytesIO
    ``_extra_state``): takes any arguments and any state, keeps none of it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __repr__(self) -> str:
        return "<ignored>"


def _ignored(path: str) -> tuple[type, str]:
    return type(path.rsplit(".", 1)[1], (Ignored,), {"__module__": __name__}), path


_ENUMS = [("megatron.core.enums", "ModelType"), ("megatron.core.transformer.enums", "ModelType"),
          ("megatron.core.transformer.enums", "LayerType"), ("megatron.core.transformer.enums", "AttnType"),
          ("megatron.core.transformer.enums", "AttnMaskType"), ("megatron.core.transformer.enums", "AttnBackend"),
          ("megatron.core.transformer.enums", "CudaGraphScope"), ("megatron.model.enums", "AttnMaskType"),
          ("megatron.model.enums", "LayerType"), ("megatron.model.enums", "AttnType"),
          ("megatron.core.datasets.utils", "Split")]
_IGNORED = ["numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct", "numpy.ndarray",
            "numpy.dtype", "numpy.dtypes.UInt32DType", "numpy.core.multiarray.scalar",
            "numpy._core.multiarray.scalar", "_io.BytesIO"]

#: the extra globals a Megatron ``.pt`` may name, each with what it becomes here
STAND_INS: list[tuple[Any, str]] = ([(argparse.Namespace, "argparse.Namespace")]
                                    + [_enum(m, n) for m, n in _ENUMS] + [_ignored(p) for p in _IGNORED])


def load_megatron_pt(path: str) -> Any:
    """A Megatron ``.pt`` file (``model_optim_rng.pt``, ``common.pt``) on CPU, unpickled with
    ``weights_only=True`` and the `STAND_INS`; CheckpointError (one line naming ``path``) when it
    names any other global or is unreadable."""
    try:
        with torch.serialization.safe_globals(STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused: it names a global outside the allowlist of a Megatron checkpoint "
                              f"({safe_pickle.describe_load_error(e)}); nothing in it was run") from None
    except Exception as e:  # noqa: BLE001 - a damaged file raises many kinds
        raise CheckpointError(f"{path}: not a Megatron checkpoint file ({safe_pickle.describe_load_error(e)})") \
            from None


_PLAN = "torch.distributed.checkpoint.planner"
_PLAN_CLASSES = {(_PLAN, n): getattr(_dcp_planner, n) for n in ("SavePlan", "WriteItem", "WriteItemType",
                                                              "TensorWriteData", "BytesIOWriteData")
                 if hasattr(_dcp_planner, n)}
_MEGATRON_GLOBALS = {**safe_pickle.ALLOWED_GLOBALS, **_PLAN_CLASSES}
_STATEFUL = {c for c in _MEGATRON_GLOBALS.values() if isinstance(c, type) and dataclasses.is_dataclass(c)}
_EXTRA_METADATA_FIELDS = {"all_local_plans", "mcore_data"}  # megatron-core's additions to DCP's Metadata


def _load_build(self: Any) -> None:
    """BUILD as megatrain's DCP unpickler allows it, plus megatron-core's cached plans on the Metadata."""
    state = self.stack.pop()
    inst = self.stack[-1]
    cls = type(inst)
    if cls not in _STATEFUL:
        raise safe_pickle._RefusedGlobal(f"refusing to set the state of a {cls.__name__} object")
    if "__setstate__" in vars(cls):
        cls.__setstate__(inst, state)
        return
    fields = {f.name for f in dataclasses.fields(cls)}
    if cls is _dcp_metadata.Metadata:
        fields |= _EXTRA_METADATA_FIELDS
    if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
        raise safe_pickle._RefusedGlobal(f"refusing state other than the fields of {cls.__name__}")
    inst.__dict__.update(state)


class _MegatronMetadataUnpickler(safe_pickle.DcpMetadataUnpickler):
    dispatch = dict(safe_pickle.DcpMetadataUnpickler.dispatch)
    dispatch[pickle.BUILD[0]] = _load_build

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (_PLAN, "WriteItemType"):
            return _dcp_planner.WriteItemType  # an enum: called with a member's value
        try:
            return _MEGATRON_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise safe_pickle._RefusedGlobal(f"refusing to unpickle the global {module}.{name}") from None


def load_megatron_dcp_metadata(ckpt: str) -> Any:
    """The DCP ``.metadata`` of a ``torch_dist`` checkpoint directory, read with the allowlist, its
    megatron-core extras dropped, and checked as megatrain checks its own."""
    path = os.path.join(ckpt, safe_pickle.DCP_METADATA)
    try:
        with open(path, "rb") as f:
            md = _MegatronMetadataUnpickler(f).load()
    except safe_pickle._RefusedGlobal as e:
        raise CheckpointError(f"{path}: {e} (a torch_dist .metadata holds DCP's metadata and plan classes only); "
                              "the checkpoint was not loaded") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: not a DCP metadata file ({safe_pickle.describe_load_error(e)})") from None
    if type(md) is _dcp_metadata.Metadata:
        for extra in _EXTRA_METADATA_FIELDS:
            md.__dict__.pop(extra, None)
    try:
        safe_pickle._check_metadata(md)
    except ValueError as e:
        raise CheckpointError(f"{path}: not a DCP metadata file megatrain can load: {e}") from None
    return md
