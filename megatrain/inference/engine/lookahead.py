"""Greedy decode steps that run one step ahead of the host.

A decode step whose rows are all plain greedy (argmax of the raw logits, no top-N logprobs) needs
nothing from the host to choose its tokens: :func:`launch` chooses them on the device, inside the
step's CUDA graph where there is one (the same float32 argmax and log-softmax as
:func:`~sampler.sample_rows`), starts copying them to pinned host
memory and returns at once with an :class:`InFlight` step. While the device runs that step, the
engine can launch the next one from the chosen tokens still on the device (:func:`launch` with the
in-flight step's tokens and positions + 1) and only then read the first step's tokens
(:meth:`InFlight.read`): the host's work per token (stop rules, events, streaming) overlaps the
device's next step instead of sitting between two steps.

A job that ends on a token read this way has one step more computed for it (its row of the step
already launched); the row writes keys only into that job's own slot, at a position no other job
reads, and its result is dropped. The engine runs ahead only while nothing else changes: no new
job can be admitted, no call or cancellation is waiting, no in-flight token is a job's last by
length, one process (a tensor-parallel step is planned for every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.inference.engine.runner import ModelRunner
from megatrain.inference.engine.scheduler import Request


@dataclass
class InFlight:
    """A launched greedy decode step: ``requests[i]`` owns row i (None: a padding row)."""

    requests: list[Request | None]
    positions: list[int]
    tokens: torch.Tensor  # [rows] float64 on the device: the step's chosen token ids
    host: torch.Tensor  # [2, rows] float64 (pinned on CUDA): chosen tokens, their logprobs
    ready: torch.cuda.Event | None  # the copy into ``host`` has finished

    def read(self) -> tuple[list[int], list[float]]:
        """The chosen tokens and their logprobs (waits for the device)."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens, logprobs = self.host.tolist()
        return [int(t) for t in tokens], logprobs


def greedy_only(requests: list[Request]) -> bool:
    """Every request chooses by the batched argmax and wants no top-N logprobs."""
    return all(r.sampler.plain_greedy and not r.job.top_logprobs for r in requests)


def launch(runner: ModelRunner, requests: list[Request | None], tokens: list[int] | torch.Tensor,
           positions: list[int], needed: int) -> InFlight:
    """One decode step of ``requests``' rows (``tokens``: host ids or the previous step's device
    tokens), its greedy tokens chosen on the device and on their way to the host."""
    out = runner.decode_greedy(tokens, positions, needed)  # chosen on the device, in the step's graph
    cuda = out.device.type == "cuda"
    host = torch.empty(out.shape, dtype=out.dtype, pin_memory=cuda)
    host.copy_(out, non_blocking=cuda)
    ready = None
    if cuda:
        ready = torch.cuda.Event()
        ready.record()
    return InFlight(requests, positions, out[0], host, ready)


def next_positions(step: InFlight, scratch_position: int) -> tuple[list[int], int]:
    """The positions of the step after ``step`` (each real row one further; padding rows stay at the
    scratch position) and the keys it reads."""
    positions = [p + 1 if r is not None else scratch_position for r, p in zip(step.requests, step.positions)]
    return positions, max(p for r, p in zip(step.requests, positions) if r is not None) + 1


def rows_of(requests: list[Request], rows: int) -> list[Request | None]:
    """``requests`` placed at their slots' rows 0..rows-1."""
    placed: list[Request | None] = [None] * rows
    for r in requests:
        assert r.slot is not None
        placed[r.slot] = r
    return placed
