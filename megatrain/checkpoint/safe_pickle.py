"""The only ways megatrain unpickles a file: DCP's ``.metadata`` through an exact allowlist, and
tensors-only files through ``torch.load(weights_only=True)``.

``.metadata`` (written by ``torch.distributed.checkpoint``) is a plain pickle of a ``Metadata``
dataclass. `DcpMetadataUnpickler` resolves a global only when its (module, name) pair is one of
`ALLOWED_GLOBALS`, a table built here from direct imports of exactly the objects DCP pickles
(its metadata dataclasses, the filesystem ``_StorageInfo``, ``torch.Size``, dtypes, the strided
layout, ``pathlib`` paths); the table maps each pair to that object, so no dotted name, module
attribute or other member of those modules is ever looked up. State (``BUILD``) is given only to
instances of DCP's metadata dataclasses, never set as attributes of a class or any other object,
which is why the unpickler is Python's pure-Python one. After unpickling, `load_dcp_metadata`
checks the whole structure (types, sizes, and that every shard it names is a plain file name in
the checkpoint directory) before anything uses it.

`load_tensors_file` reads files that hold tensors and plain containers only (RNG states, Hugging
Face ``pytorch_model*.bin``) with ``torch.load(weights_only=True)``. Every refusal or unreadable
file becomes one `CheckpointError` line naming the file (`describe_load_error` condenses
torch's multi-paragraph messages).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import pathlib
import pickle
import sys
from typing import Any, BinaryIO

import torch

from megatrain.checkpoint.errors import CheckpointError

__all__ = ["ALLOWED_GLOBALS", "DcpMetadataUnpickler", "describe_load_error", "load_dcp_metadata",
           "load_tensors_file", "read_dcp_metadata"]

DCP_METADATA = ".metadata"

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"

# dtypes a checkpoint's tensors can have; a dtype pickles as the global ``torch.<name>``.
_DTYPE_NAMES = ("bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
                "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
                "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
                "float4_e2m1fn_x2")

_MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.preserve_format)


def _layout_from_name(name: Any) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout``, as which a layout pickles: the strided one only."""
    if name != "torch.strided":
        raise pickle.UnpicklingError(f"refusing the tensor layout {name!r} (checkpoints hold dense tensors)")
    return torch.strided


@functools.cache
def _allowed_globals() -> dict[tuple[str, str], Any]:
    """`ALLOWED_GLOBALS`, built on first use (importing DCP costs every process's start-up)."""
    from torch.distributed.checkpoint import filesystem as _dcp_filesystem
    from torch.distributed.checkpoint import metadata as _dcp_metadata

    table: dict[tuple[str, str], Any] = {
        (_MD, "Metadata"): _dcp_metadata.Metadata,
        (_MD, "MetadataIndex"): _dcp_metadata.MetadataIndex,
        (_MD, "TensorStorageMetadata"): _dcp_metadata.TensorStorageMetadata,
        (_MD, "BytesStorageMetadata"): _dcp_metadata.BytesStorageMetadata,
        (_MD, "ChunkStorageMetadata"): _dcp_metadata.ChunkStorageMetadata,
        (_MD, "TensorProperties"): _dcp_metadata.TensorProperties,
        (_MD, "_MEM_FORMAT_ENCODING"): _dcp_metadata._MEM_FORMAT_ENCODING,
        (_FS, "_StorageInfo"): _dcp_filesystem._StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _layout_from_name,
        ("collections", "OrderedDict"): collections.OrderedDict,
    }
    storage_meta = getattr(_dcp_metadata, "StorageMeta", None)  # recorded since torch 2.4
    if storage_meta is not None:
        table[(_MD, "StorageMeta")] = storage_meta
    for name in _DTYPE_NAMES:
        dtype = getattr(torch, name, None)  # newer dtypes are missing from older torch
        if isinstance(dtype, torch.dtype):
            table[("torch", name)] = dtype
    # StorageMeta.checkpoint_id is the path the checkpoint was saved to; since Python 3.13 the
    # classes live in pathlib._local and may pickle under that name.
    paths = {"PosixPath": pathlib.PosixPath, "PurePosixPath": pathlib.PurePosixPath,
             "PureWindowsPath": pathlib.PureWindowsPath, "WindowsPath": pathlib.PureWindowsPath}
    for module in ("pathlib", "pathlib._local"):
        for name, cls in paths.items():
            table[(module, name)] = cls
    for (module, name), obj in table.items():
        assert callable(obj) or isinstance(obj, torch.dtype), (module, name)
        assert not isinstance(obj, type(sys)), (module, name)  # never a module
    return table


def __getattr__(name: str) -> Any:
    """``ALLOWED_GLOBALS``: every global a DCP ``.metadata`` may name, mapped to the object it stands for."""
    if name == "ALLOWED_GLOBALS":
        return _allowed_globals()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _RefusedGlobal(pickle.UnpicklingError):
    pass


@functools.cache
def _stateful() -> tuple[set[type], set[type]]:
    """The classes whose instances a pickle may fill with state (BUILD), and those of them with their
    own ``__setstate__`` (TensorProperties)."""
    stateful = {cls for cls in _allowed_globals().values() if isinstance(cls, type) and dataclasses.is_dataclass(cls)}
    return stateful, {cls for cls in stateful if "__setstate__" in vars(cls)}


def _load_build(self: DcpMetadataUnpickler) -> None:
    """BUILD, restricted: only an instance (never a class) of an allowed dataclass gets state, through
    its class's own ``__setstate__`` or as a dict of its fields; no attribute is ever set with setattr."""
    state = self.stack.pop()
    inst = self.stack[-1]
    cls = type(inst)
    stateful, own_setstate = _stateful()
    if cls not in stateful:
        raise _RefusedGlobal(f"refusing to set the state of a {cls.__name__} object")
    if cls in own_setstate:
        cls.__setstate__(inst, state)
        return
    fields = {f.name for f in dataclasses.fields(cls)}
    if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
        raise _RefusedGlobal(f"refusing state other than the fields of {cls.__name__}")
    inst.__dict__.update(state)


class DcpMetadataUnpickler(pickle._Unpickler):  # the Python implementation, whose opcodes can be restricted
    """An unpickler that resolves only the exact (module, name) pairs of `ALLOWED_GLOBALS` and fills
    only instances of DCP's metadata dataclasses with state."""

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = _load_build

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _allowed_globals()[(module, name)]
        except (KeyError, TypeError):
            raise _RefusedGlobal(f"refusing to unpickle the global {module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _RefusedGlobal("refusing a persistent reference")


# ---------------------------------------------------------------------------------------------- checks

def _fields_only(obj: Any, where: str) -> None:
    extra = set(vars(obj)) - {f.name for f in dataclasses.fields(obj)}
    if extra:
        raise ValueError(f"{where} has unexpected attributes {sorted(extra)}")


def _is_int(v: Any) -> bool:
    return type(v) is int and v >= 0


def _check_size(v: Any, where: str, ndim: int | None = None) -> None:
    if type(v) is not torch.Size or not all(_is_int(x) for x in v) or (ndim is not None and len(v) != ndim):
        raise ValueError(f"{where} is not a size of {ndim if ndim is not None else 'any number of'} dimensions")


def _check_tensor(key: str, item: Any) -> None:
    from torch.distributed.checkpoint import metadata as _dcp_metadata

    where = f"the entry {key!r}"
    _fields_only(item, where)
    props = item.properties
    if type(props) is not _dcp_metadata.TensorProperties:
        raise ValueError(f"{where} has no tensor properties")
    _fields_only(props, where)
    if (not isinstance(props.dtype, torch.dtype) or props.layout is not torch.strided
            or type(props.requires_grad) is not bool or type(props.pin_memory) is not bool
            or props.memory_format not in _MEMORY_FORMATS):
        raise ValueError(f"{where} has malformed tensor properties")
    _check_size(item.size, f"{where}'s size")
    if type(item.chunks) is not list:
        raise ValueError(f"{where} has no list of chunks")
    for chunk in item.chunks:
        if type(chunk) is not _dcp_metadata.ChunkStorageMetadata:
            raise ValueError(f"{where} has a chunk that is not a ChunkStorageMetadata")
        _fields_only(chunk, where)
        _check_size(chunk.offsets, f"a chunk of {where}", len(item.size))
        _check_size(chunk.sizes, f"a chunk of {where}", len(item.size))
        if any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, item.size)):
            raise ValueError(f"a chunk of {where} lies outside the tensor")


def _check_storage(index: Any, info: Any, keys: dict[str, Any]) -> None:
    from torch.distributed.checkpoint import filesystem as _dcp_filesystem
    from torch.distributed.checkpoint import metadata as _dcp_metadata

    if type(index) is not _dcp_metadata.MetadataIndex or type(index.fqn) is not str:
        raise ValueError("a storage entry is not keyed by a MetadataIndex")
    where = f"the storage of {index.fqn!r}"
    _fields_only(index, where)
    if index.fqn not in keys:
        raise ValueError(f"{where}: no such entry in the state dict")
    if index.offset is not None:
        _check_size(index.offset, f"{where}'s offset")
    if index.index is not None and not _is_int(index.index):
        raise ValueError(f"{where} has a malformed index")
    if type(info) is not _dcp_filesystem._StorageInfo:
        raise ValueError(f"{where} is not a _StorageInfo")
    _fields_only(info, where)
    path = info.relative_path
    if (type(path) is not str or not path or path in (".", "..") or os.path.basename(path) != path
            or "/" in path or "\\" in path or "\0" in path or path == DCP_METADATA):
        raise ValueError(f"{where} names the file {path!r}, not a shard in the checkpoint directory")
    if not _is_int(info.offset) or not _is_int(info.length):
        raise ValueError(f"{where} has a malformed offset or length")
    if getattr(info, "transform_descriptors", None):  # compression etc.: megatrain writes none
        raise ValueError(f"{where} asks for stream transforms {info.transform_descriptors!r}")


def _check_metadata(md: Any) -> None:
    """Raises ValueError naming what is wrong unless ``md`` is a plain DCP Metadata."""
    from torch.distributed.checkpoint import metadata as _dcp_metadata

    if type(md) is not _dcp_metadata.Metadata:
        raise ValueError(f"it holds a {type(md).__name__}, not a Metadata")
    _fields_only(md, "the Metadata")
    if not isinstance(md.state_dict_metadata, dict):
        raise ValueError("it has no state dict entries")
    for key, item in md.state_dict_metadata.items():
        if type(key) is not str:
            raise ValueError("a state dict key is not a string")
        if type(item) is _dcp_metadata.BytesStorageMetadata:
            _fields_only(item, f"the entry {key!r}")
        elif type(item) is _dcp_metadata.TensorStorageMetadata:
            _check_tensor(key, item)
        else:
            raise ValueError(f"the entry {key!r} is a {type(item).__name__}")
    if not isinstance(md.storage_data, dict):
        raise ValueError("it has no storage entries")
    for index, info in md.storage_data.items():
        _check_storage(index, info, md.state_dict_metadata)
    planner = md.planner_data
    if planner is not None and not (
            isinstance(planner, dict) and all(
                type(k) is str and type(v) in (tuple, list) and all(type(p) in (str, int) for p in v)
                for k, v in planner.items())):
        raise ValueError("its planner data is not a mapping of names to key paths")
    sm = getattr(md, "storage_meta", None)
    if sm is not None:
        if type(sm) is not _allowed_globals().get((_MD, "StorageMeta")):
            raise ValueError("its storage_meta is not a StorageMeta")
        _fields_only(sm, "the storage_meta")
        if (not (sm.checkpoint_id is None or isinstance(sm.checkpoint_id, (str, pathlib.PurePath)))
                or not all(v is None or type(v) is str for v in (sm.save_id, sm.load_id))
                or type(sm.modules) is not list or not all(type(m) is str for m in sm.modules)):
            raise ValueError("its storage_meta is malformed")
    version = getattr(md, "version", None)
    if version is not None and type(version) is not str:
        raise ValueError("its version is not a string")


# ---------------------------------------------------------------------------------------------- readers

def load_dcp_metadata(path: str | os.PathLike, f: BinaryIO | None = None) -> Any:
    """DCP's ``Metadata`` from the file ``path`` (or the open ``f``), unpickled with the allowlist and checked.

    Raises CheckpointError (one line naming ``path``) for a refused global or anything malformed.
    """
    try:
        if f is None:
            with open(path, "rb") as fh:
                md = DcpMetadataUnpickler(fh).load()
        else:
            md = DcpMetadataUnpickler(f).load()
    except _RefusedGlobal as e:
        raise CheckpointError(f"{path}: {e} (a DCP .metadata holds only DCP's metadata classes, sizes and "
                              f"dtypes); the checkpoint was not loaded") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - a malformed pickle raises many kinds
        raise CheckpointError(f"{path}: not a DCP metadata file ({describe_load_error(e)}); the checkpoint was "
                              f"not loaded") from None
    try:
        _check_metadata(md)
    except ValueError as e:
        raise CheckpointError(f"{path}: not a DCP metadata file megatrain can load: {e}") from None
    return md


def read_dcp_metadata(ckpt: str) -> Any:
    """DCP's ``.metadata`` of the checkpoint directory ``ckpt``, read as `load_dcp_metadata` does."""
    return load_dcp_metadata(os.path.join(ckpt, DCP_METADATA))


def describe_load_error(e: BaseException) -> str:
    """One line for an unpickling error: the refused global, never torch's advice to drop weights_only."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    boiler = ("Weights only load failed", "Check the documentation", "Please file an issue",
              "Re-running `torch.load`", "In PyTorch 2.6")
    useful = [line for line in lines if not line.startswith(boiler)]
    for i, line in enumerate(useful):
        if "WeightsUnpickler error:" in line:
            useful[i] = line.split("WeightsUnpickler error:", 1)[1].strip()
    text = useful[0] if useful else (lines[0] if lines else type(e).__name__)
    for cut in (" Please use `torch.serialization", " Please use `torch", " If you"):  # advice to allow it
        text = text.split(cut, 1)[0]
    text = text.strip()
    if not text.startswith(type(e).__name__) and not isinstance(e, pickle.UnpicklingError):
        text = f"{type(e).__name__}: {text}"
    return text if len(text) <= 300 else text[:297] + "..."


def load_tensors_file(path: str) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU; CheckpointError (one line naming ``path``) if refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused: it holds more than tensors and plain data "
                              f"({describe_load_error(e)})") from None
    except Exception as e:  # noqa: BLE001 - a damaged file raises many kinds
        raise CheckpointError(f"{path}: not a tensors file ({describe_load_error(e)})") from None
