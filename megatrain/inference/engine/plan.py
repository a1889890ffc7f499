"""One engine step as data, and how rank 0 hands it to the other tensor-parallel ranks.

A :class:`StepPlan` says everything a rank needs to run the same forwards as rank 0: the registered
functions to call (name and JSON payload), the decode step (a token and a position for each of slots
0..rows-1, and how many keys to read) and the prompts to prefill into their slots. Under tensor
parallelism rank 0 builds the plan and broadcasts it as UTF-8 JSON in a uint8 tensor (its length
first, as an int64 tensor), never as a pickle, so a rank only ever runs what the plan names. Rank 0
alone samples; the tokens it chose travel to the other ranks inside the next step's plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class StepPlan:
    """One step: ``calls`` first, then the decode of ``decode_tokens`` / ``decode_positions`` (rows
    0..len-1; empty: no decode) reading ``decode_keys`` keys, then each (slot, prompt) of ``prefills``.
    ``stop``: the engine is closing (followers return)."""

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)
    decode_positions: list[int] = field(default_factory=list)
    decode_keys: int = 0
    prefills: list[tuple[int, list[int]]] = field(default_factory=list)
    stop: bool = False

    @property
    def empty(self) -> bool:
        return not (self.calls or self.decode_tokens or self.prefills or self.stop)

    def to_json(self) -> bytes:
        return json.dumps({"calls": self.calls, "decode_tokens": self.decode_tokens,
                           "decode_positions": self.decode_positions, "decode_keys": self.decode_keys,
                           "prefills": self.prefills, "stop": self.stop}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StepPlan:
        obj = json.loads(data.decode())
        return cls(calls=[(str(name), payload) for name, payload in obj["calls"]],
                   decode_tokens=[int(t) for t in obj["decode_tokens"]],
                   decode_positions=[int(p) for p in obj["decode_positions"]],
                   decode_keys=int(obj["decode_keys"]),
                   prefills=[(int(slot), [int(t) for t in prompt]) for slot, prompt in obj["prefills"]],
                   stop=bool(obj["stop"]))


class PlanChannel:
    """Broadcast of plans from the group's rank 0 to its other ranks (tensors on ``device``: the
    backend's, CUDA for NCCL)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.source = dist.get_global_rank(group, 0)

    def send(self, plan: StepPlan) -> None:
        data = plan.to_json()
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=self.source, group=self.group)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        dist.broadcast(payload, src=self.source, group=self.group)

    def receive(self) -> StepPlan:
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=self.source, group=self.group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(payload, src=self.source, group=self.group)
        return StepPlan.from_json(payload.cpu().numpy().tobytes())
