"""How megatrain hands a checkpoint to ``torch.distributed.checkpoint`` (DCP) for loading.

`SafeFileSystemReader` is DCP's ``FileSystemReader`` except that DCP never unpickles ``.metadata``
itself: `read_metadata` returns the ``Metadata`` that megatrain read with the allowlist of
`megatrain.checkpoint.safe_pickle` (passed in, or read that way), and it refuses DCP's fallback to
per-rank ``__N.metadata`` files. Its `read_data` reads file by file through DCP's own code, which
loads every tensor with ``torch.load(weights_only=True)`` (so on every torch >= 2.6 this package
supports), and turns any failure into one `CheckpointError` naming the file.

`SafeLoadPlanner` is DCP's default load planner except that non-tensor items are loaded with
``weights_only=True`` (DCP's own planner loads them with ``weights_only=False``).

`load_dcp` is the one call megatrain loads DCP state with.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from megatrain.checkpoint import safe_pickle
from megatrain.checkpoint.errors import CheckpointError

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "load_dcp"]


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor items are loaded with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - the unpickler raises many kinds
            raise CheckpointError(f"the item {fqn!r} was refused ({safe_pickle.describe_load_error(e)})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeFileSystemReader(FileSystemReader):
    """DCP's filesystem reader with ``.metadata`` read by megatrain's allowlist (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, metadata: Any = None) -> None:
        super().__init__(path)
        self._metadata = metadata
        self._metadata_dir = os.path.abspath(os.fspath(path))

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id and os.path.abspath(os.fspath(checkpoint_id)) != self._metadata_dir:
            self._metadata = None  # read for another directory
            self._metadata_dir = os.path.abspath(os.fspath(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        if rank is not None:
            raise CheckpointError(f"{self._metadata_dir}: megatrain reads only the checkpoint's global "
                                  f"{safe_pickle.DCP_METADATA}, not __{rank}{safe_pickle.DCP_METADATA}")
        if self._metadata is None:
            self._metadata = safe_pickle.read_dcp_metadata(self._metadata_dir)
        md = self._metadata
        storage_meta = safe_pickle.ALLOWED_GLOBALS.get(("torch.distributed.checkpoint.metadata", "StorageMeta"))
        if storage_meta is not None and getattr(md, "storage_meta", None) is None:
            md.storage_meta = storage_meta()
        if getattr(md, "storage_meta", None) is not None and hasattr(self, "load_id"):
            md.storage_meta.load_id = self.load_id  # as DCP's reader does
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError as e:
                raise CheckpointError(f"{os.path.join(self._metadata_dir, name)}: {e}") from e
            except pickle.UnpicklingError as e:
                raise CheckpointError(f"{os.path.join(self._metadata_dir, name)}: refused: its tensor data holds "
                                      f"more than tensors ({safe_pickle.describe_load_error(e)})") from e
            except Exception as e:  # noqa: BLE001 - torch.load and file reads raise many kinds
                raise CheckpointError(f"{os.path.join(self._metadata_dir, name)}: cannot be loaded "
                                      f"({safe_pickle.describe_load_error(e)})") from e
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _refusal(e: CheckpointException) -> CheckpointError | None:
    """The CheckpointError some rank raised inside DCP (rank-prefixed when it was not this one)."""
    failures = getattr(e, "failures", None) or {}
    for rank, failure in sorted(failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, CheckpointError):
            return exc if len(failures) == 1 else CheckpointError(f"rank {rank}: {exc}")
    return None


def load_dcp(state_dict: dict[str, Any], ckpt: str, metadata: Any = None, *, allow_partial_load: bool = False) -> None:
    """``dcp.load`` of ``ckpt`` into ``state_dict`` through `SafeFileSystemReader` and `SafeLoadPlanner`.

    ``metadata`` is the checkpoint's ``.metadata`` already read with `safe_pickle.read_dcp_metadata`
    (it is read that way here otherwise); DCP uses that object and never opens ``.metadata``.
    A refused or unreadable file raises one CheckpointError line naming it.
    """
    if metadata is None:
        metadata = safe_pickle.read_dcp_metadata(ckpt)
    reader = SafeFileSystemReader(ckpt, metadata=metadata)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(allow_partial_load=allow_partial_load))
    except CheckpointException as e:
        refused = _refusal(e)
        if refused is None:
            raise
        raise CheckpointError(str(refused)) from e
