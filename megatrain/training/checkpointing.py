"""Checkpoints in Megatron's directory layout, tensors stored with PyTorch distributed checkpoint (DCP).

Layout (guide §3.5)::

    SAVE/latest_checkpointed_iteration.txt     iteration number of the newest complete checkpoint
    SAVE/iter_0000100/                         one checkpoint
        .metadata, __*_*.distcp                DCP shards: model and optimizer state (global shapes)
        meta.json                              iteration, consumed samples, scheduler, loss scaler,
                                               model config, layout, args (plain JSON)
        rng_rank00000.pt                       RNG states of each rank (tensors only; weights_only)
        complete_rank00000.json                per-rank completeness marker: the files the rank
                                               wrote, their sizes and checksums; written last

Writing: every rank writes its shards and RNG file into ``iter_XXXXXXX.tmp``, then its marker;
after all markers exist rank 0 renames the directory to ``iter_XXXXXXX`` and only then replaces
``latest_checkpointed_iteration.txt``. A crash at any point leaves either a ``.tmp`` directory
(ignored and cleaned up later) or a complete checkpoint.

Loading: `find_checkpoint` checks completeness (markers of every rank, listed files present with
their sizes and checksums, metadata; `megatrain.checkpoint.integrity`) and falls back, with a
warning, to the newest older complete checkpoint; a checkpoint named by the user (an ``iter_``
directory, ``--ckpt-step``) that does not check out is refused. The checksums are verified by all
ranks together, each reading the files of its share of the markers.
`load_checkpoint` compares the checkpoint's tensor shapes with the model and refuses a mismatch
with a list of the differences (``finetune=True`` loads the tensors both have, same shape).
Nothing in a checkpoint is unpickled beyond plain data (`megatrain.checkpoint.safe_pickle`): DCP's
``.metadata`` is read with an exact allowlist and handed to DCP, which never opens it itself
(`megatrain.checkpoint.dcp_reader`); tensors, non-tensor items and RNG files load with
``weights_only=True``.

`load_checkpoint` refuses NaN/Inf in the loaded model and optimizer state unless told otherwise.

`Checkpointer` adds ``--async-save`` (the state is copied to host memory, the files are written
by a background thread while training continues) and ``--keep-last-checkpoints K`` retention. A
save that fails writing (disk full, quota, I/O error) raises `CheckpointSaveError`, one line,
after removing its own ``iter_XXXXXXX.tmp``; earlier checkpoints and the tracker stay as they were.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import os
import random
import re
import shutil
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from megatrain.atomic_io import atomic_write_bytes, atomic_write_text
from megatrain.checkpoint import integrity
from megatrain.checkpoint.dcp_reader import load_dcp
from megatrain.checkpoint.errors import CheckpointError
from megatrain.checkpoint.safe_pickle import load_tensors_file, read_dcp_metadata
from megatrain.errors import underlying
from megatrain.json_input import parse_json
from megatrain.models.gpt.config import GPTConfig

# Optimizer state keyed by parameter name, hyper-parameters included ("param_groups.<name>.lr"), so
# every rank's entries are distinct (pipeline stages hold different parameters) and a checkpoint
# reshards across any layout.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"
DCP_METADATA = ".metadata"
# 2: completeness markers with sizes; 3: and checksums (format 2 checkpoints still load).
FORMAT_VERSION = 3
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
# One process without torch.distributed is an intended way to save (also from the async writer thread).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# How each GPTConfig field is compared between a checkpoint and the flags (docs/checkpoints.md has
# the same table). "compare": a difference changes the model's numbers (or its tensors) and is
# refused unless --use-checkpoint-args takes the checkpoint's value (--finetune: a warning);
# "rope": compared only when both use rotary positions; "learned": only with learned positions
# (with RoPE there is no position table and the value changes nothing); "warn": a warning (the
# GELU of --no-bias-gelu-fusion, a fused-kernel choice in Megatron-LM); "no": may legitimately
# differ. The value is the flag named in the message.
CONFIG_CHECKS: dict[str, tuple[str, str]] = {
    "num_layers": ("compare", "--num-layers"),
    "hidden_size": ("compare", "--hidden-size"),
    "num_attention_heads": ("compare", "--num-attention-heads"),
    "vocab_size": ("compare", "--vocab-size"),  # padded; resume_vocab_size keeps the checkpoint's when it fits
    "max_position_embeddings": ("learned", "--max-position-embeddings"),
    "ffn_hidden_size": ("compare", "--ffn-hidden-size"),
    "kv_channels": ("compare", "--kv-channels"),
    "num_query_groups": ("compare", "--num-query-groups"),
    "position_embedding_type": ("compare", "--position-embedding-type"),
    "rotary_base": ("rope", "--rotary-base"),
    "rotary_percent": ("rope", "--rotary-percent"),
    "normalization": ("compare", "--normalization"),
    "norm_epsilon": ("compare", "--norm-epsilon"),
    "apply_layernorm_1p": ("compare", "--apply-layernorm-1p"),
    "swiglu": ("compare", "--swiglu"),
    "gelu_approximation": ("warn", "--no-bias-gelu-fusion"),
    "add_bias_linear": ("compare", "--disable-bias-linear"),
    "untie_embeddings_and_output_weights": ("compare", "--untie-embeddings-and-output-weights"),
    "fp32_residual_connection": ("no", "--fp32-residual-connection"),  # precision of the residual stream
    "hidden_dropout": ("no", "--hidden-dropout"),
    "attention_dropout": ("no", "--attention-dropout"),
    "init_method_std": ("no", "--init-method-std"),  # initialisation only; the loaded weights replace it
}
# Boolean fields whose flag means False.
_INVERTED_FLAGS = {"add_bias_linear"}


class CheckpointSaveError(CheckpointError):
    """A save that could not be written (the message names the directory and the system's reason)."""


@dataclass
class TrainState:
    """Counters that make a run resumable."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when torch.distributed is not initialised: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*experimental.*")
        yield


def checkpoint_dir(save: str, iteration: int) -> str:
    return os.path.join(save, f"iter_{iteration:07d}")


def _marker_name(rank: int) -> str:
    return integrity.marker_name(rank)


def _rng_name(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _world() -> int:
    return dist.get_world_size() if _dist_on() else 1


def _warn(message: str) -> None:
    if _rank() == 0:
        print(f"WARNING: {message}", flush=True)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------------- RNG

def rng_state() -> dict[str, torch.Tensor]:
    """This rank's RNG states as tensors (loadable with ``weights_only=True``)."""
    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python_version": torch.tensor([py[0]], dtype=torch.int64),
        "python_state": torch.tensor(py[1], dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if py[2] is None else py[2]], dtype=torch.float64),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": torch.tensor([np_state[2], np_state[3]], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_state[4]], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    gauss = float(state["python_gauss"][0])
    random.setstate((int(state["python_version"][0]), tuple(int(x) for x in state["python_state"].tolist()),
                     None if gauss != gauss else gauss))
    pos = state["numpy_pos"].tolist()
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), int(pos[0]), int(pos[1]),
                         float(state["numpy_gauss"][0])))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------------------------------------- saving

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
    world = _world()
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    return {"world_size": world, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "context_parallel_size": cp, "data_parallel_size": world // (tp * pp * cp),
            "zero_stage": int(getattr(args, "zero_stage", 0) or 0),
            "sequence_parallel": bool(getattr(args, "sequence_parallel", False))}


def _plain(obj: Any) -> Any:
    """A JSON round trip: a frozen copy of plain data (scheduler and scaler states)."""
    return json.loads(json.dumps(obj))


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
    if _dist_on():
        entries = [None] * _world()
        dist.all_gather_object(entries, (reason, p.published), group=p.group)
    failed = next(((r, e) for r, e in enumerate(entries) if e[0] is not None), None)
    if failed is None:
        return
    rank, (reason, published) = failed
    if p.rank == 0 and not published:
        shutil.rmtree(p.tmp, ignore_errors=True)
    if error is not None and _os_error(error) is None:
        raise error
    raise CheckpointSaveError(_failure_message(p, (f"rank {rank}: " if len(entries) > 1 else "") + reason,
                                               published))


def _finish(p: _PendingSave) -> None:
    """After this rank's shards are written: RNG, meta, marker; rank 0 publishes the checkpoint."""
    error: BaseException | None = None
    try:
        if p.rng is not None:
            buf = io.BytesIO()
            torch.save(p.rng, buf)
            atomic_write_bytes(os.path.join(p.tmp, _rng_name(p.rank)), buf.getvalue(), fsync=True)
        if p.rank == 0 and p.meta is not None:
            atomic_write_text(os.path.join(p.tmp, META), json.dumps(p.meta, indent=1, sort_keys=True), fsync=True)
        mine = [n for n in os.listdir(p.tmp) if n.startswith(f"__{p.rank}_") or n == _rng_name(p.rank)
                or (p.rank == 0 and n in (META, DCP_METADATA))]
        for name in mine:  # the data must be on disk before the marker says so
            with open(os.path.join(p.tmp, name), "rb") as f:
                os.fsync(f.fileno())
        atomic_write_text(os.path.join(p.tmp, _marker_name(p.rank)),
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
    missing = [r for r in range(p.world) if not os.path.isfile(os.path.join(p.tmp, _marker_name(r)))]
    if missing:
        raise RuntimeError(f"checkpoint {p.tmp}: ranks {missing} did not complete; not publishing it")
    _fsync_dir(p.tmp)
    old = None
    if os.path.exists(p.final):  # saving the same iteration again: keep the old one until the new is in place
        old = p.final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(p.final, old)
    os.replace(p.tmp, p.final)
    p.published = True
    _fsync_dir(p.save)
    atomic_write_text(os.path.join(p.save, TRACKER), f"{p.iteration}\n", fsync=True)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    _clean_up(p.save, p.iteration, p.keep_last)


def _iterations_in(save: str) -> list[int]:
    """Iterations with an ``iter_XXXXXXX`` directory in ``save``, newest first."""
    try:
        names = os.listdir(save)
    except FileNotFoundError:
        return []
    its = [int(m.group(1)) for n in names if (m := _ITER_RE.match(n)) and os.path.isdir(os.path.join(save, n))]
    return sorted(its, reverse=True)


def _clean_up(save: str, newest: int, keep_last: int | None) -> None:
    """Remove stale ``.tmp`` directories, and complete checkpoints beyond the newest ``keep_last``."""
    for name in os.listdir(save):
        if name.startswith("iter_") and name.endswith(".tmp") and os.path.isdir(os.path.join(save, name)):
            shutil.rmtree(os.path.join(save, name), ignore_errors=True)
    if not keep_last:
        return
    complete = [it for it in _iterations_in(save) if it <= newest and checkpoint_problem(checkpoint_dir(save, it)) is None]
    if newest not in complete:  # never delete anything when the one just written does not check out
        return
    cutoff = complete[keep_last - 1] if len(complete) >= keep_last else None
    if cutoff is None:
        return
    for it in _iterations_in(save):
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


_ASYNC_HAS_STAGER = "async_stager" in inspect.signature(dcp.async_save).parameters


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
        if _dist_on() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def save(self, save: str, state: TrainState, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             extra_state: dict[str, Any], args: argparse.Namespace, model_config: Any, *,
             save_optim: bool = True, save_rng: bool = True) -> SaveReport:
        t0 = time.perf_counter()
        self.wait()
        final = checkpoint_dir(save, state.iteration)
        tmp = final + ".tmp"
        rank, world = _rank(), _world()
        error: BaseException | None = None
        if rank == 0:
            try:
                os.makedirs(save, exist_ok=True)
                if os.path.exists(tmp):
                    shutil.rmtree(tmp)
                os.makedirs(tmp)
            except OSError as e:
                error = e
        try:
            _agree(_PendingSave(save, state.iteration, tmp, final, rank, world, None, None, None), error)
        except CheckpointSaveError as e:
            raise CheckpointSaveError(str(e)) from None
        with_optim = bool(save_optim and optimizer is not None)
        if with_optim:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIM_OPTIONS)
            to_save = {"model": model_sd, "optimizer": optim_sd}
        else:
            to_save = {"model": get_state_dict(model, [])[0]}
        meta = None
        if rank == 0:
            meta = {"format_version": FORMAT_VERSION, "train_state": asdict(state),
                    "model_config": asdict(model_config), "has_optimizer": with_optim, "has_rng": bool(save_rng),
                    "world_size": world, "layout": _layout(args), "args": _jsonable_args(args),
                    "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch_version": torch.__version__,
                    **_plain(extra_state)}
        pending = _PendingSave(save, state.iteration, tmp, final, rank, world, meta,
                               rng_state() if save_rng else None, self.keep_last)
        if not self.async_save:
            def write() -> None:
                with _single_process_quiet():
                    dcp.save(to_save, checkpoint_id=tmp)
            _write_and_finish(pending, write)
            return SaveReport(final, time.perf_counter() - t0, False)
        pending.group = self._async_group()
        pending.started = time.perf_counter()
        with _single_process_quiet():
            future = self._start_async(to_save, tmp, pending.group)
        self._thread = threading.Thread(target=self._background, args=(future, pending), daemon=True,
                                        name=f"checkpoint-{state.iteration}")
        self._thread.start()
        return SaveReport(final, time.perf_counter() - t0, True)

    def _start_async(self, to_save: dict[str, Any], tmp: str, group: Any) -> Any:
        on_cuda = torch.cuda.is_available() and any(
            isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in _leaves(to_save))
        if _ASYNC_HAS_STAGER:
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
                print(f" checkpoint at iteration {pending.iteration:7d} written in the background to "
                      f"{pending.final} ({self.last_write_s:.2f} s)", flush=True)
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


def _leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


def save_checkpoint(save: str, state: TrainState, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    extra_state: dict[str, Any], args: argparse.Namespace, model_config: Any, *,
                    save_optim: bool = True, save_rng: bool = True, keep_last: int | None = None) -> str:
    """Write ``SAVE/iter_XXXXXXX`` (synchronously, crash-safe) and update the tracker; returns the directory."""
    return Checkpointer(keep_last=keep_last).save(save, state, model, optimizer, extra_state, args, model_config,
                                                  save_optim=save_optim, save_rng=save_rng).path


# ---------------------------------------------------------------------------------------------- finding

def _markers(ckpt: str) -> tuple[list[integrity.Marker], str | None]:
    """The checkpoint's completeness markers, checked against its files' sizes: (markers, problem or None)."""
    if not os.path.isdir(ckpt):
        return [], "no such directory"
    try:
        meta = read_meta(ckpt)
    except FileNotFoundError:
        return [], f"{META} is missing"
    except (OSError, ValueError, RecursionError) as e:
        return [], f"{META} is unreadable ({str(e).splitlines()[0][:200]})"
    if not isinstance(meta, dict):
        return [], f"{META} is not a JSON object"
    if not os.path.isfile(os.path.join(ckpt, DCP_METADATA)):
        return [], f"DCP {DCP_METADATA} is missing"
    version, world = meta.get("format_version", 1), meta.get("world_size", 1)
    if not isinstance(version, int) or not isinstance(world, int) or world < 1:
        return [], f"{META} is damaged (format_version {version!r}, world_size {world!r})"
    if version < 2:
        return [], None  # written before completeness markers existed
    markers = []
    for rank in range(world):
        try:
            marker = integrity.read_marker(ckpt, rank)
        except FileNotFoundError:
            return [], f"rank {rank} did not finish ({_marker_name(rank)} is missing)"
        except OSError as e:
            return [], f"{_marker_name(rank)} is unreadable ({e.strerror or e})"
        except integrity.MarkerError as e:
            return [], str(e)
        problem = integrity.size_problem(ckpt, marker)
        if problem:
            return [], problem
        if version >= 3 and marker.checksums is None:
            return [], f"{marker.name} holds no checksums (checkpoint format {version} writes them; edited or damaged)"
        markers.append(marker)
    return markers, None


def checkpoint_problem(ckpt: str, verify: bool = False) -> str | None:
    """Why ``ckpt`` cannot be loaded (missing, incomplete, truncated), or None when it is complete.

    With ``verify`` every file's content is also checked against its checksums (this reads the
    whole checkpoint; `find_checkpoint` shares that work out over the ranks).
    """
    markers, problem = _markers(ckpt)
    if problem is None and verify:
        problem = integrity.checksum_problem(ckpt, markers)
    return problem


def is_complete(ckpt: str) -> bool:
    return checkpoint_problem(ckpt) is None


def _find(load: str, step: int | None, verify: Any = None) -> str | None:
    """`find_checkpoint` on one process; ``verify(ckpt, markers)`` returns a checksum problem or None."""

    def problem_of(ckpt: str) -> str | None:
        markers, problem = _markers(ckpt)
        return verify(ckpt, markers) if problem is None and verify is not None else problem

    if os.path.isfile(os.path.join(load, META)) or _ITER_RE.match(os.path.basename(os.path.normpath(load))):
        problem = problem_of(load)
        if problem:
            raise SystemExit(f"error: --load {load}: the checkpoint is not usable: {problem}")
        return load
    if not os.path.isdir(load):
        if step is not None:
            raise SystemExit(f"error: --load {load}: no such directory")
        return None  # as in Megatron: `--save D --load D` starts from scratch on the first launch
    if step is not None:
        ckpt = checkpoint_dir(load, step)
        problem = problem_of(ckpt)
        if problem:
            have = [it for it in _iterations_in(load) if it != step and is_complete(checkpoint_dir(load, it))]
            raise SystemExit(f"error: --ckpt-step {step}: {ckpt}: {problem}; other complete checkpoints in --load: "
                             f"{', '.join(map(str, sorted(have))) or 'none'}")
        return ckpt
    tracker = os.path.join(load, TRACKER)
    newest: int | None = None
    if os.path.isfile(tracker):
        text = open(tracker, encoding="utf-8", errors="replace").read(100).strip()
        try:
            newest = int(text)
        except ValueError:
            _warn(f"--load {load}: {TRACKER} does not hold an iteration number ({text!r}); "
                  f"looking for the newest complete checkpoint")
    candidates = [it for it in _iterations_in(load) if newest is None or it <= newest]
    if newest is not None and newest not in candidates:
        candidates.insert(0, newest)
    if not os.path.isfile(tracker) and not candidates:
        return None
    if not os.path.isfile(tracker):
        _warn(f"--load {load}: no {TRACKER}; looking for the newest complete checkpoint")
    for it in candidates:
        ckpt = checkpoint_dir(load, it)
        problem = problem_of(ckpt)
        if problem is None:
            return ckpt
        _warn(f"checkpoint {ckpt} is not usable ({problem}); falling back to an earlier one")
    raise SystemExit(f"error: --load {load}: no complete checkpoint found"
                     + (f" (iterations tried: {', '.join(map(str, candidates))})" if candidates else ""))


def _verify_share(ckpt: str, rank: int, world: int, markers: list[integrity.Marker] | None = None) -> str | None:
    """The checksum problem among the files of the markers ``m`` with ``m % world == rank`` (this rank's share:
    at the saving layout, the files this rank wrote and mostly reads), or None. ``markers``: the
    checkpoint's, when the caller has read them already."""
    if markers is None:
        markers, problem = _markers(ckpt)
        if problem is not None:
            return problem
    return integrity.checksum_problem(ckpt, [m for m in markers if m.rank % world == rank])


def find_checkpoint(load: str, step: int | None = None, *, verify: bool = True) -> str | None:
    """The directory to load from ``--load`` (a SAVE dir or an iter_ dir), or None when there is none.

    Rank 0 decides (with warnings for skipped broken checkpoints) and tells the other ranks. With
    ``verify`` (the default) the files' checksums are verified too: on one process by it, in a job
    by every rank for its share of the files, the candidate being refused when any rank finds a
    changed file.
    """
    if not _dist_on() or _world() == 1:
        return _find(load, step, integrity.checksum_problem if verify else None)
    rank, world = _rank(), _world()

    def verify_together(ckpt: str, markers: list[integrity.Marker]) -> str | None:  # rank 0; the others wait below
        dist.broadcast_object_list([("verify", ckpt)], src=0)
        return _gather_problem(_verify_share(ckpt, rank, world, markers))

    result: list[Any] = [None]
    if rank == 0:
        try:
            result[0] = ("ok", _find(load, step, verify_together if verify else None))
        except SystemExit as e:
            result[0] = ("error", str(e))
        except BaseException as e:  # the other ranks must not wait for a decision that never comes
            dist.broadcast_object_list([("error", f"error: --load {load}: rank 0 failed: {e!r}")], src=0)
            raise
        dist.broadcast_object_list(result, src=0)
    else:
        while True:
            dist.broadcast_object_list(result, src=0)
            if result[0][0] != "verify":
                break
            _gather_problem(_verify_share(result[0][1], rank, world))
    kind, value = result[0]
    if kind == "error":
        raise SystemExit(value)
    return value


def _gather_problem(problem: str | None) -> str | None:
    """The first rank's problem of all ranks' (every rank calls this)."""
    problems: list[Any] = [None] * _world()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def read_meta(ckpt: str) -> dict[str, Any]:
    path = os.path.join(ckpt, META)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        meta = parse_json(raw)
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: must hold a JSON object, not {type(meta).__name__}")
    return meta


# ---------------------------------------------------------------------------------------------- loading

def resume_vocab_size(ckpt: str, padded: int, true_vocab: int, tensor_parallel_size: int) -> int:
    """The padded vocabulary to build when loading ``ckpt``: the checkpoint's, when it fits this layout.

    Megatron pads the vocabulary to a multiple of ``--make-vocab-size-divisible-by x TP``, so a
    checkpoint saved under another TP size can have more (or fewer) padding rows. Its size is kept
    when it holds the whole vocabulary and divides by the new TP size; the padding rows never
    receive a target, so the run continues with the same numbers.
    """
    saved = int(read_meta(ckpt).get("model_config", {}).get("vocab_size", padded))
    if saved == padded or saved < true_vocab or saved % tensor_parallel_size:
        return padded
    if _rank() == 0:
        print(f" note: using the checkpoint's padded vocabulary of {saved} (the flags give {padded}; the "
              f"padding depends on --make-vocab-size-divisible-by x --tensor-model-parallel-size)", flush=True)
    return saved


def _global_shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape)


def compare_model(ckpt_shapes: dict[str, tuple[int, ...]], model_sd: dict[str, Any]) -> dict[str, list[str]]:
    """Tensor names missing from the checkpoint, unexpected in it, and present in both with other shapes."""
    want = {k: _global_shape(v) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    return {"missing": sorted(k for k in want if k not in ckpt_shapes),
            "unexpected": sorted(k for k in ckpt_shapes if k not in want),
            "shape": sorted(f"{k}: checkpoint {list(ckpt_shapes[k])}, model {list(want[k])}"
                            for k in want if k in ckpt_shapes and tuple(ckpt_shapes[k]) != want[k])}


_GELU_NAMES = {"none": "exact GELU", "tanh": "tanh-approximated GELU"}


def checkpoint_gelu_approximation(model_config: dict[str, Any]) -> str:
    """The GELU a checkpoint's model was trained with (checkpoints from before the choice existed
    used exact GELU)."""
    return str(model_config.get("gelu_approximation", "none"))


def config_differences(saved: dict[str, Any], current: Any) -> list[str]:
    """One line per model-config value that the checkpoint's config (``saved``, from its meta.json)
    and ``current`` (a GPTConfig or its dict) disagree on and that :data:`CONFIG_CHECKS` compares,
    naming the flag and both values. A field the checkpoint does not record counts as the
    GPTConfig default (the behaviour before the field existed)."""
    if not saved:  # a checkpoint that records no model config
        return []
    cur = asdict(current) if not isinstance(current, dict) else current
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    positions = {saved.get("position_embedding_type", defaults["position_embedding_type"]),
                 cur.get("position_embedding_type")}
    compared = {"compare": True, "rope": positions == {"rope"}, "learned": positions == {"learned_absolute"}}
    out = []
    for name, (how, flag) in CONFIG_CHECKS.items():
        if not compared.get(how, False) or name not in cur:
            continue
        ours, theirs = cur[name], saved.get(name, defaults.get(name))
        if theirs is None or theirs == ours:
            continue
        if isinstance(ours, bool):
            given = ["with" if v != (name in _INVERTED_FLAGS) else "without" for v in (theirs, ours)]
            line = f"{flag}: checkpoint {given[0]}, flags {given[1]}"
        else:
            line = f"{flag}: checkpoint {theirs}, flags {ours}"
        if name == "apply_layernorm_1p":
            line += " (the norm weights would mean another scale)"
        if name == "vocab_size":
            line += (" (the padded vocabulary; it depends on --make-vocab-size-divisible-by x "
                     "--tensor-model-parallel-size: choose them so the padding matches)")
        out.append(line)
    return out


def _model_shapes(metadata: Any) -> dict[str, tuple[int, ...]]:
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(md, "size"):
            out[key[len("model."):]] = tuple(md.size)
    return out


def load_checkpoint(ckpt: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                    load_optim: bool = True, load_rng: bool = True, model_config: Any = None,
                    finetune: bool = False, allow_non_finite: bool = False) -> dict[str, Any]:
    """Load model (and optimizer, RNG) state in place; returns the checkpoint's meta data.

    Raises CheckpointError listing the differences when the checkpoint's tensors do not fit the model
    or its model config differs from ``model_config`` in a value :data:`CONFIG_CHECKS` compares.
    With ``finetune`` tensors that exist in both with the same shape are loaded, the model's others
    keep their values, and config differences are a warning. Without ``model_config`` (exporters,
    inference: the model is built from the checkpoint's own config) no config is compared. A loaded
    tensor holding NaN/Inf is refused (on every rank alike) unless ``allow_non_finite``.
    """
    meta = read_meta(ckpt)
    metadata = read_dcp_metadata(ckpt)
    model_sd = get_state_dict(model, [])[0]
    diff = compare_model(_model_shapes(metadata), model_sd)
    if getattr(model, "is_pipeline_stage", False):
        diff["unexpected"] = []  # the other pipeline stages' tensors
    saved_cfg = meta.get("model_config", {})
    cfg_diff = config_differences(saved_cfg, model_config) if model_config is not None else []
    if model_config is not None and saved_cfg and not getattr(model_config, "swiglu", True):
        saved_gelu = checkpoint_gelu_approximation(saved_cfg)
        if saved_gelu != model_config.gelu_approximation:
            _warn(f"checkpoint {ckpt} was trained with {_GELU_NAMES[saved_gelu]} and the flags give "
                  f"{_GELU_NAMES[model_config.gelu_approximation]} (the default with linear biases is the tanh "
                  f"approximation, as Megatron-LM's fused bias-GELU; --no-bias-gelu-fusion gives exact GELU; "
                  f"--use-checkpoint-args takes the checkpoint's)")
    fatal = diff["shape"] or (not finetune and (diff["missing"] or diff["unexpected"] or cfg_diff))
    if fatal:
        lines = cfg_diff + [f"shape differs: {s}" for s in diff["shape"]]
        if not finetune:
            lines += [f"not in the checkpoint: {k}" for k in diff["missing"]]
            lines += [f"in the checkpoint but not in the model: {k}" for k in diff["unexpected"]]
        raise CheckpointError(f"checkpoint {ckpt} does not match the model built from the flags:\n  "
                              + "\n  ".join(lines[:40]) + (f"\n  ... and {len(lines) - 40} more" if len(lines) > 40
                                                          else "")
                              + "\n(--use-checkpoint-args builds the checkpoint's model"
                              + ("" if finetune else "; --finetune loads only the tensors both have, when "
                                                     "their shapes agree") + ")")
    if finetune and cfg_diff:  # as Megatron-LM, --finetune does not hold the model to the checkpoint's
        _warn(f"--finetune: the model differs from checkpoint {ckpt}'s: " + "; ".join(cfg_diff))
    if finetune and (diff["missing"] or diff["unexpected"]):
        _warn(f"--finetune: {len(diff['missing'])} tensors keep their initial values (not in the checkpoint: "
              f"{', '.join(diff['missing'][:8])}); {len(diff['unexpected'])} checkpoint tensors are not used")
    has_optim = bool(meta.get("has_optimizer", False))
    if load_optim and optimizer is not None and not has_optim:
        _warn(f"checkpoint {ckpt} holds no optimizer state (saved with --no-save-optim); the optimizer starts fresh")
    load_optim = load_optim and optimizer is not None and has_optim
    if load_optim:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIM_OPTIONS)
        sd: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
    else:
        sd = {"model": model_sd}
    partial = finetune and bool(diff["missing"])
    if partial:
        sd = {"model": {k: v for k, v in model_sd.items() if k not in set(diff["missing"])}}
    with _single_process_quiet():
        load_dcp(sd, ckpt, metadata, allow_partial_load=partial)
    _refuse_non_finite(ckpt, sd, allow_non_finite)
    if partial:
        full = dict(model_sd)
        full.update(sd["model"])
        set_state_dict(model, [], model_state_dict=full, optim_state_dict={},
                       options=StateDictOptions(strict=False))
    elif load_optim:
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"],
                       options=OPTIM_OPTIONS)
    else:
        set_state_dict(model, [], model_state_dict=sd["model"], optim_state_dict={},
                       options=StateDictOptions(strict=True))
    if load_rng:
        restore_rng(ckpt, meta)
    return meta


def _refuse_non_finite(ckpt: str, sd: dict[str, Any], allow: bool) -> None:
    """CheckpointError (on every rank) naming the loaded tensors with NaN/Inf values; a warning with ``allow``."""
    bad = integrity.non_finite_tensors(sd)
    if _dist_on() and _world() > 1:
        everyone: list[Any] = [None] * _world()
        dist.all_gather_object(everyone, bad)
        bad = sorted({name for names in everyone for name in names})
    if not bad:
        return
    names = ", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
    count = f"{len(bad)} tensor{'s' if len(bad) > 1 else ''}"
    if allow:
        _warn(f"checkpoint {ckpt} holds NaN/Inf values in {count} ({names}); loading them "
              f"(--allow-non-finite-checkpoint)")
        return
    raise CheckpointError(f"checkpoint {ckpt} holds NaN/Inf values in {count} ({names}); training "
                          f"from it would produce NaN losses (load an earlier checkpoint, or pass "
                          f"--allow-non-finite-checkpoint to load it anyway)")


def restore_rng(ckpt: str, meta: dict[str, Any] | None = None) -> bool:
    """Set this rank's RNG states from the checkpoint; False (with a warning) when it holds none for this rank.

    Call it last when resuming: anything that draws random numbers afterwards (creating a
    DataLoader iterator draws one) would otherwise shift the streams against the original run.
    """
    meta = read_meta(ckpt) if meta is None else meta
    if not meta.get("has_rng"):
        return False
    rng_file = os.path.join(ckpt, _rng_name(_rank()))
    if not os.path.isfile(rng_file):
        _warn(f"checkpoint {ckpt} has no RNG state for rank {_rank()} (saved with {meta.get('world_size')} "
              f"ranks); this rank keeps its seeded RNG")
        return False
    state = load_tensors_file(rng_file)
    try:
        set_rng_state(state)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{rng_file}: not an RNG state file ({type(e).__name__}: {e})") from None
    return True
