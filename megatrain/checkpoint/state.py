"""What a checkpoint holds of a run besides its tensors' values: the counters that make it
resumable (`TrainState`), each rank's RNG states as tensors, and the state-dict options the
optimizer state is saved and loaded with."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["TrainState", "optim_options", "rng_name", "rng_state", "set_rng_state"]


def optim_options() -> Any:
    """DCP's ``StateDictOptions`` for the optimizer state: keyed by parameter name, hyper-parameters
    included ("param_groups.<name>.lr"), so every rank's entries are distinct (pipeline stages hold
    different parameters) and a checkpoint reshards across any layout. (DCP is imported on first use,
    not at start-up.)"""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class TrainState:
    """Counters that make a run resumable."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def rng_name(rank: int) -> str:
    """The file of ``rank``'s RNG states in a checkpoint directory."""
    return f"rng_rank{rank:05d}.pt"


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
