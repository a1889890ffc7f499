"""Writing checkpoints: crash-safe, synchronous or in the background (``--async-save``), with
``--keep-last-checkpoints K`` retention.

Every rank writes its DCP shards and RNG file into ``iter_XXXXXXX.tmp``, then its completeness
marker; once every marker exists rank 0 renames the directory to ``iter_XXXXXXX`` and only then
replaces ``latest_checkpointed_iteration.txt``. A crash at any point leaves either a ``.tmp``
directory (ignored, removed by the next save) or a complete checkpoint. A save that fails writing
(disk full, quota, I/O error; on any rank) raises `CheckpointSaveError` on every rank, one line,
after removing its own ``.tmp``; earlier checkpoints and the tracker stay as they were.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatrain.atomic_io import atomic_write_bytes, atomic_write_text
from megatrain.checkpoint import integrity
from megatrain.checkpoint.errors import CheckpointSaveError
from megatrain.checkpoint.layout import DCP_METADATA, TRACKER, checkpoint_dir, checkpoint_problem, iterations_in
from megatrain.checkpoint.meta import META, build_meta
from megatrain.checkpoint.ranks import dist_on, fsync_dir, rank, single_process_quiet, world
from megatrain.checkpoint.state import TrainState, optim_options, rng_name, rng_state
from megatrain.errors import underlying

__all__ = ["Checkpointer", "SaveReport", "save_checkpoint"]


@dataclass
class _PendingSave:
    """What a save needs after the tensors are on their way: written by `_finish` on every rank."""

    save: str
    iteration: int
    tmp: str
    final: str
    rank: int
    world: int
    meta: dict[str, Any] | None  # rank 0 only
    rng: dict[str, torch.Tensor] | None
    keep_last: int | None
    group: Any = None
    started: float = 0.0
    published: bool = False  # rank 0: the directory has its final name


def _os_error(error: BaseException | None) -> OSError | None:
    """The OSError behind ``error`` (itself, a rank's failure inside DCP's CheckpointException, its
    cause or context)."""
    found = underlying(error, lambda e: isinstance(e, OSError) and e.errno is not None)
    return found if isinstance(found, OSError) else None


def _os_error_text(error: BaseException) -> str | None:
    """``error``'s system reason in one line ("No space left on device (writing __0_0.distcp)"), or None."""
    e = _os_error(error)
    if e is None:
        return None
    where = os.path.basename(str(e.filename)) if e.filename else None
    return (e.strerror or os.strerror(e.errno or 0)) + (f" (writing {where})" if where else "")


def _failure_message(p: _PendingSave, reason: str, published: bool) -> str:
    if published:
        return (f"--save {p.save}: the checkpoint of iteration {p.iteration} is in {p.final} but {TRACKER} could "
                f"not be updated: {reason}")
    return (f"--save {p.save}: cannot write the checkpoint of iteration {p.iteration}: {reason}; the earlier "
            f"checkpoints and {TRACKER} are unchanged")


def _save_failed(p: _PendingSave, error: BaseException) -> BaseException:
    """The error to raise for a save that failed on every rank at once (DCP shares its failures).

    A file-system error becomes a one-line CheckpointSaveError and rank 0 removes the save's
    temporary directory; other errors (bugs, interrupts) are returned as they are, the directory
    then left for the next save's clean-up.
    """
    if isinstance(error, CheckpointSaveError):
        return error
    reason = _os_error_text(error)
    if reason is None:
        return error
    if p.rank == 0 and not p.published:
        shutil.rmtree(p.tmp, ignore_errors=True)
    return CheckpointSaveError(_failure_message(p, reason, p.published))


def _write_and_finish(p: _PendingSave, write: Any) -> None:
    """``write()`` this rank's shards (or wait for them), then `_finish`; a failure raises `_save_failed`'s error."""
    try:
        write()
        _finish(p)
    except BaseException as e:
        failure = _save_failed(p, e)
        if failure is e:
            raise
        raise failure from None


def _agree(p: _PendingSave, error: BaseException | None) -> None:
    """A barrier of the save's ranks that also tells each whether one failed; then every rank raises
    (`_save_failed`'s rules, with the first failing rank's reason)."""
    reason = None if error is None else (_os_error_text(error) or f"{type(error).__name__}: {error}")
    entries: list[Any] = [(reason, p.published)]
    if dist_on():
        entries = [None] * world()
        dist.all_gather_object(entries, (reason, p.published), group=p.group)
    failed = next(((r, e) for r, e in enumerate(entries) if e[0] is not None), None)
    if failed is None:
        return
    failing_rank, (reason, published) = failed
    if p.rank == 0 and not published:
        shutil.rmtree(p.tmp, ignore_errors=True)
    if error is not None and _os_error(error) is None:
        raise error
    raise CheckpointSaveError(_failure_message(p, (f"rank {failing_rank}: " if len(entries) > 1 else "") + reason,
                                               published))


def _finish(p: _PendingSave) -> None:
    """After this rank's shards are written: RNG, meta, marker; rank 0 publishes the checkpoint."""
    error: BaseException | None = None
    try:
        if p.rng is not None:
            buf = io.BytesIO()
            torch.save(p.rng, buf)
            atomic_write_bytes(os.path.join(p.tmp, rng_name(p.rank)), buf.getvalue(), fsync=True)
        if p.rank == 0 and p.meta is not None:
            atomic_write_text(os.path.join(p.tmp, META), json.dumps(p.meta, indent=1, sort_keys=True), fsync=True)
        mine = [n for n in os.listdir(p.tmp) if n.startswith(f"__{p.rank}_") or n == rng_name(p.rank)
                or (p.rank == 0 and n in (META, DCP_METADATA))]
        for name in mine:  # the data must be on disk before the marker says so
            with open(os.path.join(p.tmp, name), "rb") as f:
                os.fsync(f.fileno())
        atomic_write_text(os.path.join(p.tmp, integrity.marker_name(p.rank)),
                          integrity.marker_text(p.tmp, p.rank, p.world, p.iteration, mine), fsync=True)
    except Exception as e:  # noqa: BLE001 - every rank learns of it in _agree
        error = e
    _agree(p, error)
    if p.rank == 0:
        try:
            _publish(p)
        except Exception as e:  # noqa: BLE001 - every rank learns of it in _agree
            error = e
    _agree(p, error)


def _publish(p: _PendingSave) -> None:
    """Rank 0, once every rank's marker is written: rename the directory, update the tracker, retention."""
    missing = [r for r in range(p.world) if not os.path.isfile(os.path.join(p.tmp, integrity.marker_name(r)))]
    if missing:
        raise RuntimeError(f"checkpoint {p.tmp}: ranks {missing} did not complete; not publishing it")
    fsync_dir(p.tmp)
    old = None
    if os.path.exists(p.final):  # saving the same iteration again: keep the old one until the new is in place
        old = p.final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(p.final, old)
    os.replace(p.tmp, p.final)
    p.published = True
    fsync_dir(p.save)
    atomic_write_text(os.path.join(p.save, TRACKER), f"{p.iteration}\n", fsync=True)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    _clean_up(p.save, p.iteration, p.keep_last)


def _clean_up(save: str, newest: int, keep_last: int | None) -> None:
    """Remove stale ``.tmp`` directories, and complete checkpoints beyond the newest ``keep_last``."""
    for name in os.listdir(save):
        if name.startswith("iter_") and name.endswith(".tmp") and os.path.isdir(os.path.join(save, name)):
            shutil.rmtree(os.path.join(save, name), ignore_errors=True)
    if not keep_last:
        return
    complete = [it for it in iterations_in(save) if it <= newest and checkpoint_problem(checkpoint_dir(save, it)) is None]
    if newest not in complete:  # never delete anything when the one just written does not check out
        return
    cutoff = complete[keep_last - 1] if len(complete) >= keep_last else None
    if cutoff is None:
        return
    for it in iterations_in(save):
        if it < cutoff:
            path = checkpoint_dir(save, it)
            doomed = path + ".deleting"
            os.replace(path, doomed)  # a half-deleted directory is never mistaken for a checkpoint
            shutil.rmtree(doomed, ignore_errors=True)


def _copy_for_async(sd: Any) -> Any:
    """A copy of CPU tensors (older DCP versions stage CPU tensors without copying them)."""
    if isinstance(sd, dict):
        return {k: _copy_for_async(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_copy_for_async(v) for v in sd]
    if isinstance(sd, torch.Tensor) and sd.device.type == "cpu":
        return sd.detach().clone()
    return sd


def _leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


@dataclass
class SaveReport:
    path: str
    blocked_s: float  # how long the caller (the training loop) waited
    asynchronous: bool


class Checkpointer:
    """Saves checkpoints synchronously or in the background, and applies retention.

    ``save`` returns once the training loop may continue: after the whole checkpoint is written
    (synchronous) or after the state is copied to host memory (``async_save``). `wait` blocks until
    a background save is complete and published; it runs before the next save and must run
    before exit (`close`).
    """

    def __init__(self, async_save: bool = False, keep_last: int | None = None, verbose: bool = True):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"--keep-last-checkpoints must be at least 1, got {keep_last}")
        self.async_save = async_save
        self.keep_last = keep_last
        self.verbose = verbose
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group: Any = None
        self._stager: Any = None
        self.last_write_s: float | None = None  # background write time of the last finished async save

    def _async_group(self) -> Any:
        """A gloo group for the background thread, so its collectives never mix with training's."""
        if dist_on() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def save(self, save: str, state: TrainState, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             extra_state: dict[str, Any], args: argparse.Namespace, model_config: Any, *,
             save_optim: bool = True, save_rng: bool = True, model_state: dict[str, Any] | None = None,
             planner: Any = None) -> SaveReport:
        """``model_state`` / ``planner`` (synchronous saves without an optimizer only): the model's
        state dict as given (meta tensors, say) and a DCP SavePlanner whose ``resolve_data`` makes each
        tensor as it is written, so a converter never holds the whole model (the HF import)."""
        import torch.distributed.checkpoint as dcp  # here, not at import: DCP costs start-up time
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        if (model_state is not None or planner is not None) and (self.async_save or (save_optim and optimizer)):
            raise ValueError("model_state / planner: synchronous saves without optimizer state only")
        self.wait()
        final = checkpoint_dir(save, state.iteration)
        tmp = final + ".tmp"
        me, world_size = rank(), world()
        error: BaseException | None = None
        if me == 0:
            try:
                os.makedirs(save, exist_ok=True)
                if os.path.exists(tmp):
                    shutil.rmtree(tmp)
                os.makedirs(tmp)
            except OSError as e:
                error = e
        try:
            _agree(_PendingSave(save, state.iteration, tmp, final, me, world_size, None, None, None), error)
        except CheckpointSaveError as e:
            raise CheckpointSaveError(str(e)) from None
        with_optim = bool(save_optim and optimizer is not None)
        if with_optim:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=optim_options())
            to_save = {"model": model_sd, "optimizer": optim_sd}
        else:
            to_save = {"model": get_state_dict(model, [])[0] if model_state is None else model_state}
        meta = None
        if me == 0:
            meta = build_meta(state, model_config, args, extra_state, has_optimizer=with_optim,
                              has_rng=bool(save_rng))
        pending = _PendingSave(save, state.iteration, tmp, final, me, world_size, meta,
                               rng_state() if save_rng else None, self.keep_last)
        if not self.async_save:
            def write() -> None:
                with single_process_quiet():
                    if planner is None:
                        dcp.save(to_save, checkpoint_id=tmp)
                    else:  # serial writes in state-dict order (per_thread_copy_ahead=0: no read-ahead)
                        dcp.save(to_save, storage_writer=dcp.FileSystemWriter(tmp, per_thread_copy_ahead=0),
                                 planner=planner)
            _write_and_finish(pending, write)
            return SaveReport(final, time.perf_counter() - t0, False)
        pending.group = self._async_group()
        pending.started = time.perf_counter()
        with single_process_quiet():
            future = self._start_async(to_save, tmp, pending.group)
        self._thread = threading.Thread(target=self._background, args=(future, pending), daemon=True,
                                        name=f"checkpoint-{state.iteration}")
        self._thread.start()
        return SaveReport(final, time.perf_counter() - t0, True)

    def _start_async(self, to_save: dict[str, Any], tmp: str, group: Any) -> Any:
        import torch.distributed.checkpoint as dcp

        on_cuda = torch.cuda.is_available() and any(
            isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in _leaves(to_save))
        if "async_stager" in inspect.signature(dcp.async_save).parameters:
            kwargs: dict[str, Any] = {}
            if on_cuda:  # pinned host buffers, kept between saves: the copy is the only blocking part
                from torch.distributed.checkpoint.staging import BlockingAsyncStager

                if self._stager is None:
                    self._stager = BlockingAsyncStager(cache_staged_state_dict=True)
                kwargs["async_stager"] = self._stager
            return dcp.async_save(to_save, checkpoint_id=tmp, process_group=group, **kwargs)
        return dcp.async_save(_copy_for_async(to_save), checkpoint_id=tmp, process_group=group)

    def _background(self, future: Any, pending: _PendingSave) -> None:
        try:
            upload = getattr(future, "upload_completion", future)  # AsyncSaveResponse in newer torch
            _write_and_finish(pending, upload.result)
            self.last_write_s = time.perf_counter() - pending.started
            if self.verbose and pending.rank == 0:
                # One write (print writes the text and the newline separately): the training thread's
                # log lines must not land between them.
                sys.stdout.write(f" checkpoint at iteration {pending.iteration:7d} written in the background to "
                                 f"{pending.final} ({self.last_write_s:.2f} s)\n")
                sys.stdout.flush()
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by wait()
            self._error = e

    def wait(self) -> None:
        """Block until a background save is complete and published (re-raises its error)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, CheckpointSaveError):
                raise CheckpointSaveError(f"the background checkpoint save failed: {err}") from None
            raise RuntimeError(f"the background checkpoint save failed: {err}") from err

    def close(self) -> None:
        self.wait()
        if self._stager is not None and hasattr(self._stager, "close"):
            self._stager.close()
        self._stager = None


def save_checkpoint(save: str, state: TrainState, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    extra_state: dict[str, Any], args: argparse.Namespace, model_config: Any, *,
                    save_optim: bool = True, save_rng: bool = True, keep_last: int | None = None,
                    model_state: dict[str, Any] | None = None, planner: Any = None) -> str:
    """Write ``SAVE/iter_XXXXXXX`` (synchronously, crash-safe) and update the tracker; returns the directory."""
    return Checkpointer(keep_last=keep_last).save(save, state, model, optimizer, extra_state, args, model_config,
                                                  save_optim=save_optim, save_rng=save_rng, model_state=model_state,
                                                  planner=planner).path
