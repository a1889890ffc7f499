"""Checkpoints in Megatron's directory layout, tensors stored with PyTorch distributed checkpoint (DCP).

Layout (guide §3.5)::

    SAVE/latest_checkpointed_iteration.txt     iteration number of the newest complete checkpoint
    SAVE/iter_0000100/                         one checkpoint
        .metadata, __*_*.distcp                DCP shards: model and optimizer state
        meta.json                              iteration, consumed samples, scheduler, loss scaler, args
        rng_rank00000.pt                       RNG states of each rank (tensors only; weights_only loadable)

A checkpoint is written under ``iter_XXXXXXX.tmp`` and renamed when complete on every rank;
``latest_checkpointed_iteration.txt`` is replaced atomically afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"
FORMAT_VERSION = 1


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
        yield


def checkpoint_dir(save: str, iteration: int) -> str:
    return os.path.join(save, f"iter_{iteration:07d}")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def _jsonable_args(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for k, v in vars(args).items():
        try:
            json.dumps(v)
            out[k] = v
        except TypeError:
            out[k] = repr(v)
    return out


def save_checkpoint(
    save: str,
    state: TrainState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra_state: dict[str, Any],
    args: argparse.Namespace,
    model_config: Any,
    *,
    save_optim: bool = True,
    save_rng: bool = True,
) -> str:
    """Write ``SAVE/iter_XXXXXXX`` atomically and update the tracker file; returns the directory."""
    final = checkpoint_dir(save, state.iteration)
    tmp = final + ".tmp"
    rank = _rank()
    if rank == 0:
        os.makedirs(save, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier()
    if save_optim and optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        to_save = {"model": model_sd, "optimizer": optim_sd}
    else:
        to_save = {"model": get_state_dict(model, [])[0]}
    with _single_process_quiet():
        dcp.save(to_save, checkpoint_id=tmp)
    if save_rng:
        torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank:05d}.pt"))
    _barrier()
    if rank == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "train_state": asdict(state),
            "model_config": asdict(model_config),
            "has_optimizer": bool(save_optim and optimizer is not None),
            "has_rng": save_rng,
            "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
            "args": _jsonable_args(args),
            **extra_state,
        }
        _atomic_write_text(os.path.join(tmp, META), json.dumps(meta, indent=1, sort_keys=True))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(os.path.join(save, TRACKER), f"{state.iteration}\n")
    _barrier()
    return final


def is_complete(ckpt: str) -> bool:
    return os.path.isfile(os.path.join(ckpt, META)) and os.path.isfile(os.path.join(ckpt, ".metadata"))


def find_checkpoint(load: str, step: int | None = None) -> str | None:
    """The directory to load from ``--load`` (a SAVE dir or an iter_ dir), or None when there is none."""
    if is_complete(load):
        return load
    if not os.path.isdir(load):
        raise SystemExit(f"error: --load {load}: no such directory")
    if step is not None:
        ckpt = checkpoint_dir(load, step)
        if not is_complete(ckpt):
            raise SystemExit(f"error: --ckpt-step {step}: no complete checkpoint at {ckpt}")
        return ckpt
    tracker = os.path.join(load, TRACKER)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker, encoding="utf-8").read().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise SystemExit(f"error: --load {load}: {tracker} does not hold an iteration number: {text!r}")
    ckpt = checkpoint_dir(load, iteration)
    if not is_complete(ckpt):
        raise SystemExit(f"error: --load {load}: checkpoint {ckpt} named by {TRACKER} is incomplete")
    return ckpt


def read_meta(ckpt: str) -> dict[str, Any]:
    with open(os.path.join(ckpt, META), encoding="utf-8") as f:
        return json.load(f)


def load_checkpoint(
    ckpt: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    load_optim: bool = True,
    load_rng: bool = True,
) -> dict[str, Any]:
    """Load model (and optimizer, RNG) state in place; returns the checkpoint's meta data."""
    meta = read_meta(ckpt)
    load_optim = load_optim and optimizer is not None and meta.get("has_optimizer", False)
    if load_optim:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sd = {"model": model_sd, "optimizer": optim_sd}
    else:
        sd = {"model": get_state_dict(model, [])[0]}
    with _single_process_quiet():
        dcp.load(sd, checkpoint_id=ckpt)
    if load_optim:
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    else:
        set_state_dict(model, [], model_state_dict=sd["model"], optim_state_dict={},
                       options=StateDictOptions(strict=True))
    rng_file = os.path.join(ckpt, f"rng_rank{_rank():05d}.pt")
    if load_rng and meta.get("has_rng") and os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=True))
    return meta
