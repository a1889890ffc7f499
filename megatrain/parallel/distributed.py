"""Process-group set-up from the launcher's environment: torchrun, SLURM (srun), or a single process.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Under ``srun`` without
torchrun, :func:`setup_env_from_slurm` fills the same variables from SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID and the first host of SLURM_NODELIST (port from the job id), so every later step reads
one set of variables. The backend is nccl on CUDA and gloo on CPU.
"""

from __future__ import annotations

import gc
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import MutableMapping

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedEnv:
    rank: int
    world_size: int
    local_rank: int
    source: str  # "torchrun", "slurm" or "single"


def first_slurm_host(nodelist: str) -> str:
    """The first host name of a SLURM host list: ``"gpu[003-010,012],cpu1"`` -> ``"gpu003"``."""
    depth, first = 0, []
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            break
        depth += ch == "["
        depth -= ch == "]"
        first.append(ch)
    host = "".join(first)
    # Replace each bracket group by its first element, keeping zero padding.
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], host)


def setup_env_from_slurm(environ: MutableMapping[str, str] | None = None) -> bool:
    """Fill RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from SLURM_* when RANK is not set.

    Returns True when the rank variables were taken from SLURM. Variables already set are kept, so
    ``srun torchrun ...`` and an explicit MASTER_ADDR both win over the SLURM values; MASTER_ADDR and
    MASTER_PORT are filled from SLURM whenever they are missing.
    """
    env = os.environ if environ is None else environ
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return False
    taken = "RANK" not in env
    if taken:
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    if "MASTER_ADDR" not in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        env["MASTER_ADDR"] = first_slurm_host(nodelist) if nodelist else "127.0.0.1"
    if "MASTER_PORT" not in env:
        job_id = int(env.get("SLURM_JOB_ID", "0") or 0)
        env["MASTER_PORT"] = str(20000 + job_id % 20000)
    return taken


def env_from_environ(environ: MutableMapping[str, str] | None = None) -> DistributedEnv:
    """Rank, world size and local rank from the environment (after SLURM variables are mapped)."""
    env = os.environ if environ is None else environ
    from_slurm = setup_env_from_slurm(env)
    if "RANK" not in env:
        return DistributedEnv(0, int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0")), "single")
    try:
        rank, world, local = int(env["RANK"]), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0"))
    except ValueError as e:
        raise ValueError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers: {e}") from None
    if not 0 <= rank < world:
        raise ValueError(f"RANK ({rank}) must be in [0, WORLD_SIZE={world})")
    return DistributedEnv(rank, world, local, "slurm" if from_slurm else "torchrun")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(device: torch.device, timeout_minutes: float = 10.0) -> DistributedEnv:
    """Initialise the default process group when the world has more than one process.

    Sets the CUDA device to LOCAL_RANK first. With a single process nothing is initialised.
    """
    env = env_from_environ()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.world_size > 1 and not dist.is_initialized():
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise ValueError(f"{var} is not set: launch with torchrun, srun, or set {var} yourself")
        kwargs = {}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(backend=backend_for(device), rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(minutes=timeout_minutes), **kwargs)
    return env


def init_single_process_group(device: torch.device) -> None:
    """A process group of this one process (for FSDP2 on one device); no launcher variables needed."""
    if not dist.is_initialized():
        dist.init_process_group(backend=backend_for(device), store=dist.HashStore(), rank=0, world_size=1)


def destroy_distributed(synchronize: bool = False) -> None:
    """Destroy every process group while the interpreter is still fully alive.

    ``synchronize`` (a run that ended normally on every rank): a barrier first, so that no rank
    closes its connections while another still tears down its own (the peers then see their sockets
    close in the middle of the destruction). Never after a failure: the other ranks may be gone.

    Process groups that only unreachable objects still hold (a model's hooks, a mesh) would
    otherwise be freed by the garbage collection inside interpreter shutdown; gloo's worker
    threads then need the GIL to drop their last tensors and the process aborts with
    "terminate called without an active exception". Collecting here frees them in time.
    """
    if dist.is_available() and dist.is_initialized():
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
