"""Checkpoints in Megatron's directory layout, tensors stored with PyTorch distributed checkpoint (DCP).

Layout (guide §3.5)::

    SAVE/latest_checkpointed_iteration.txt     iteration number of the newest complete checkpoint
    SAVE/iter_0000100/                         one checkpoint
        .metadata, __*_*.distcp                DCP shards: model and optimizer state (global shapes)
        meta.json                              iteration, consumed samples, scheduler, loss scaler,
                                               model config, layout, args (plain JSON)
        rng_rank00000.pt                       RNG states of each rank (tensors only; weights_only)
        complete_rank00000.json                per-rank completeness marker: the files the rank
                                               wrote and their sizes; written last

Writing: every rank writes its shards and RNG file into ``iter_XXXXXXX.tmp``, then its marker;
after all markers exist rank 0 renames the directory to ``iter_XXXXXXX`` and only then replaces
``latest_checkpointed_iteration.txt``. A crash at any point leaves either a ``.tmp`` directory
(ignored and cleaned up later) or a complete checkpoint.

Loading: `find_checkpoint` checks completeness (markers of every rank, listed files present with
their sizes, metadata) and falls back, with a warning, to the newest older complete checkpoint.
`load_checkpoint` compares the checkpoint's tensor shapes with the model and refuses a mismatch
with a list of the differences (``finetune=True`` loads the tensors both have, same shape).
Nothing in a checkpoint is unpickled beyond plain data (`megatrain.checkpoint.safe_pickle`): DCP's
``.metadata`` is read with an exact allowlist and handed to DCP, which never opens it itself
(`megatrain.checkpoint.dcp_reader`); tensors, non-tensor items and RNG files load with
``weights_only=True``.

`Checkpointer` adds ``--async-save`` (the state is copied to host memory, the files are written
by a background thread while training continues) and ``--keep-last-checkpoints K`` retention.
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
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from megatrain.atomic_io import atomic_write_bytes, atomic_write_text
from megatrain.checkpoint.dcp_reader import load_dcp
from megatrain.checkpoint.errors import CheckpointError
from megatrain.checkpoint.safe_pickle import load_tensors_file, read_dcp_metadata

# Optimizer state keyed by parameter name, hyper-parameters included ("param_groups.<name>.lr"), so
# every rank's entries are distinct (pipeline stages hold different parameters) and a checkpoint
# reshards across any layout.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"
DCP_METADATA = ".metadata"
FORMAT_VERSION = 2
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
# One process without torch.distributed is an intended way to save (also from the async writer thread).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# Fields of the model config that decide which tensors exist and their shapes.
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings",
                "ffn_hidden_size", "kv_channels", "num_query_groups", "position_embedding_type", "normalization",
                "swiglu", "add_bias_linear", "untie_embeddings_and_output_weights")


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
    return f"complete_rank{rank:05d}.json"


def _rng_name(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _world() -> int:
    return dist.get_world_size() if _dist_on() else 1


def _barrier(group: Any = None) -> None:
    if _dist_on():
        dist.barrier(group=group)


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


def _finish(p: _PendingSave) -> None:
    """After this rank's shards are written: RNG, meta, marker; rank 0 publishes the checkpoint."""
    if p.rng is not None:
        buf = io.BytesIO()
        torch.save(p.rng, buf)
        atomic_write_bytes(os.path.join(p.tmp, _rng_name(p.rank)), buf.getvalue(), fsync=True)
    if p.rank == 0 and p.meta is not None:
        atomic_write_text(os.path.join(p.tmp, META), json.dumps(p.meta, indent=1, sort_keys=True), fsync=True)
    mine = [n for n in os.listdir(p.tmp)
            if n.startswith(f"__{p.rank}_") or n == _rng_name(p.rank) or (p.rank == 0 and n in (META, DCP_METADATA))]
    for name in mine:  # the data must be on disk before the marker says so
        with open(os.path.join(p.tmp, name), "rb") as f:
            os.fsync(f.fileno())
    marker = {"rank": p.rank, "world_size": p.world, "iteration": p.iteration,
              "files": {n: os.path.getsize(os.path.join(p.tmp, n)) for n in sorted(mine)}}
    atomic_write_text(os.path.join(p.tmp, _marker_name(p.rank)), json.dumps(marker, sort_keys=True), fsync=True)
    _barrier(p.group)
    if p.rank == 0:
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
        _fsync_dir(p.save)
        atomic_write_text(os.path.join(p.save, TRACKER), f"{p.iteration}\n", fsync=True)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        _clean_up(p.save, p.iteration, p.keep_last)
    _barrier(p.group)


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
        if rank == 0:
            os.makedirs(save, exist_ok=True)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        _barrier()
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
            with _single_process_quiet():
                dcp.save(to_save, checkpoint_id=tmp)
            _finish(pending)
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
            upload.result()
            _finish(pending)
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

def checkpoint_problem(ckpt: str) -> str | None:
    """Why ``ckpt`` cannot be loaded (missing, incomplete, truncated), or None when it is complete."""
    if not os.path.isdir(ckpt):
        return "no such directory"
    try:
        meta = read_meta(ckpt)
    except FileNotFoundError:
        return f"{META} is missing"
    except (OSError, ValueError) as e:
        return f"{META} is unreadable ({e})"
    if not os.path.isfile(os.path.join(ckpt, DCP_METADATA)):
        return f"DCP {DCP_METADATA} is missing"
    if int(meta.get("format_version", 1)) < 2:
        return None  # written before completeness markers existed
    world = int(meta.get("world_size", 1))
    for rank in range(world):
        path = os.path.join(ckpt, _marker_name(rank))
        try:
            with open(path, encoding="utf-8") as f:
                files = json.load(f)["files"]
        except FileNotFoundError:
            return f"rank {rank} did not finish ({_marker_name(rank)} is missing)"
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{_marker_name(rank)} is unreadable ({e})"
        for name, size in files.items():
            file = os.path.join(ckpt, name)
            if not os.path.isfile(file):
                return f"{name} is missing"
            actual = os.path.getsize(file)
            if actual != size:
                return f"{name} has {actual} bytes, {size} were written (truncated or changed)"
    return None


def is_complete(ckpt: str) -> bool:
    return checkpoint_problem(ckpt) is None


def _find(load: str, step: int | None) -> str | None:
    if os.path.isfile(os.path.join(load, META)) or _ITER_RE.match(os.path.basename(os.path.normpath(load))):
        problem = checkpoint_problem(load)
        if problem:
            raise SystemExit(f"error: --load {load}: the checkpoint is incomplete: {problem}")
        return load
    if not os.path.isdir(load):
        if step is not None:
            raise SystemExit(f"error: --load {load}: no such directory")
        return None  # as in Megatron: `--save D --load D` starts from scratch on the first launch
    if step is not None:
        ckpt = checkpoint_dir(load, step)
        problem = checkpoint_problem(ckpt)
        if problem:
            have = [it for it in _iterations_in(load) if is_complete(checkpoint_dir(load, it))]
            raise SystemExit(f"error: --ckpt-step {step}: {ckpt}: {problem}; complete checkpoints in --load: "
                             f"{', '.join(map(str, sorted(have))) or 'none'}")
        return ckpt
    tracker = os.path.join(load, TRACKER)
    newest: int | None = None
    if os.path.isfile(tracker):
        text = open(tracker, encoding="utf-8").read().strip()
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
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt
        _warn(f"checkpoint {ckpt} is not usable ({problem}); falling back to an earlier one")
    raise SystemExit(f"error: --load {load}: no complete checkpoint found"
                     + (f" (iterations tried: {', '.join(map(str, candidates))})" if candidates else ""))


def find_checkpoint(load: str, step: int | None = None) -> str | None:
    """The directory to load from ``--load`` (a SAVE dir or an iter_ dir), or None when there is none.

    Rank 0 decides (with warnings for skipped broken checkpoints) and tells the other ranks.
    """
    if not _dist_on() or _world() == 1:
        return _find(load, step)
    result: list[Any] = [None]
    if _rank() == 0:
        try:
            result[0] = ("ok", _find(load, step))
        except SystemExit as e:
            result[0] = ("error", str(e))
    dist.broadcast_object_list(result, src=0)
    kind, value = result[0]
    if kind == "error":
        raise SystemExit(value)
    return value


def read_meta(ckpt: str) -> dict[str, Any]:
    with open(os.path.join(ckpt, META), encoding="utf-8") as f:
        return json.load(f)


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
    cur = asdict(current) if not isinstance(current, dict) else current
    out = []
    for name in SHAPE_FIELDS:
        if name in saved and name in cur and saved[name] != cur[name]:
            hint = ""
            if name == "vocab_size":
                hint = (" (the padded vocabulary; it depends on --make-vocab-size-divisible-by x "
                        "--tensor-model-parallel-size: choose them so the padding matches)")
            out.append(f"--{name.replace('_', '-')}: checkpoint {saved[name]}, flags {cur[name]}{hint}")
    return out


def _model_shapes(metadata: Any) -> dict[str, tuple[int, ...]]:
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(md, "size"):
            out[key[len("model."):]] = tuple(md.size)
    return out


def load_checkpoint(ckpt: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                    load_optim: bool = True, load_rng: bool = True, model_config: Any = None,
                    finetune: bool = False) -> dict[str, Any]:
    """Load model (and optimizer, RNG) state in place; returns the checkpoint's meta data.

    Raises CheckpointError listing the differences when the checkpoint's tensors do not fit the model.
    With ``finetune`` tensors that exist in both with the same shape are loaded, the model's others
    keep their values (a warning names them).
    """
    meta = read_meta(ckpt)
    metadata = read_dcp_metadata(ckpt)
    model_sd = get_state_dict(model, [])[0]
    diff = compare_model(_model_shapes(metadata), model_sd)
    if getattr(model, "is_pipeline_stage", False):
        diff["unexpected"] = []  # the other pipeline stages' tensors
    saved_cfg = meta.get("model_config", {})
    cfg_diff = config_differences(saved_cfg, model_config) if model_config is not None else []
    saved_1p = bool(saved_cfg.get("apply_layernorm_1p", False))
    if model_config is not None and saved_1p != bool(getattr(model_config, "apply_layernorm_1p", False)):
        raise CheckpointError(f"checkpoint {ckpt} was saved {'with' if saved_1p else 'without'} --apply-layernorm-1p "
                              f"and the flags say {'without' if saved_1p else 'with'} it: its norm weights would "
                              f"mean a different scale; {'add' if saved_1p else 'drop'} --apply-layernorm-1p")
    if model_config is not None and saved_cfg and not getattr(model_config, "swiglu", True):
        saved_gelu = checkpoint_gelu_approximation(saved_cfg)
        if saved_gelu != model_config.gelu_approximation:
            _warn(f"checkpoint {ckpt} was trained with {_GELU_NAMES[saved_gelu]} and the flags give "
                  f"{_GELU_NAMES[model_config.gelu_approximation]} (the default with linear biases is the tanh "
                  f"approximation, as Megatron-LM's fused bias-GELU; --no-bias-gelu-fusion gives exact GELU; "
                  f"--use-checkpoint-args takes the checkpoint's)")
    fatal = diff["shape"] or (not finetune and (diff["missing"] or diff["unexpected"]))
    if fatal:
        lines = cfg_diff + [f"shape differs: {s}" for s in diff["shape"]]
        if not finetune:
            lines += [f"not in the checkpoint: {k}" for k in diff["missing"]]
            lines += [f"in the checkpoint but not in the model: {k}" for k in diff["unexpected"]]
        raise CheckpointError(f"checkpoint {ckpt} does not match the model built from the flags:\n  "
                              + "\n  ".join(lines[:40]) + (f"\n  ... and {len(lines) - 40} more" if len(lines) > 40
                                                          else "")
                              + ("" if finetune else "\n(--finetune loads only the tensors both have, when "
                                                     "their shapes agree)"))
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
