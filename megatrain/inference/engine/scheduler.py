"""Which jobs run: the bounded FIFO of waiting requests, the slots of the running ones, stop rules.

A request waits (at most ``max_waiting`` of them; one more is :class:`~api.EngineFull`) until a slot
frees; slots are handed out lowest first, so the decode batch (slots 0..highest running) stays short.
After each token the request's stop rules decide whether it ends: "stop" after ``eod`` or a stop
sequence, "length" at ``max_new_tokens`` or when prompt + generated tokens fill the slot.

:meth:`Scheduler.submit` and a handle's ``cancel`` are called from any thread; everything else only
from the engine thread.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from megatrain.inference.engine.api import EngineFull, GenerateJob, TokenEvent
from megatrain.inference.engine.sampler import JobSampler


@dataclass(eq=False)
class Request:
    """A submitted job and its progress."""

    id: int
    job: GenerateJob
    on_event: Callable[[TokenEvent], None]
    sampler: JobSampler
    slot: int | None = None
    generated: list[int] = field(default_factory=list)
    cancel_requested: bool = False
    done: bool = False

    def cancel(self) -> None:
        """api.JobHandle: the engine ends the job with "cancelled" at its next step."""
        self.cancel_requested = True

    @property
    def stored(self) -> int:
        """Tokens whose keys/values are in the slot (the last generated one is not yet fed back)."""
        return len(self.job.prompt_ids) + len(self.generated) - 1

    def finish_reason(self, max_sequence_length: int) -> str | None:
        """Why the job ends after its latest token, or None."""
        job, out = self.job, self.generated
        if job.eod is not None and out[-1] == job.eod:
            return "stop"
        if any(len(seq) > 0 and out[-len(seq):] == list(seq) for seq in job.stop_token_sequences):
            return "stop"
        if len(out) >= job.max_new_tokens or len(job.prompt_ids) + len(out) >= max_sequence_length:
            return "length"
        return None


class Scheduler:
    """Waiting queue and slots (see the module docstring)."""

    def __init__(self, max_requests: int, max_waiting: int, retry_after_s: int = 1) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_requests = max_requests
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._ids = itertools.count()
        self._free = list(range(max_requests))  # a heap: the lowest free slot first
        self.running: dict[int, Request] = {}  # slot -> request

    def new_id(self) -> int:
        return next(self._ids)

    def submit(self, request: Request) -> None:
        with self._lock:
            # room: a free slot nobody waits for yet, or a place in the queue
            if len(self._waiting) >= len(self._free) + self.max_waiting:
                raise EngineFull(f"all {self.max_requests} slots are busy and {len(self._waiting)} jobs wait "
                                 f"(the limit); retry later", self.retry_after_s)
            self._waiting.append(request)

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self.running or self._waiting)

    def admission_pending(self) -> bool:
        """A waiting request could take a free slot, or asked to cancel (the next step must see it)."""
        with self._lock:
            return bool(self._waiting) and (bool(self._free) or any(r.cancel_requested for r in self._waiting))

    def take_cancelled_waiting(self) -> list[Request]:
        """Waiting requests whose cancel was asked, removed from the queue."""
        with self._lock:
            cancelled = [r for r in self._waiting if r.cancel_requested]
            if cancelled:
                self._waiting = deque(r for r in self._waiting if not r.cancel_requested)
            return cancelled

    def take_all_waiting(self) -> list[Request]:
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
            return waiting

    def admit(self) -> list[Request]:
        """Move waiting requests (first come, first served) into free slots; returns them."""
        admitted = []
        with self._lock:
            while self._waiting and self._free:
                request = self._waiting.popleft()
                request.slot = heapq.heappop(self._free)
                self.running[request.slot] = request
                admitted.append(request)
        return admitted

    def release(self, request: Request) -> None:
        """The request ended: its slot is free again."""
        request.done = True
        if request.slot is not None and self.running.get(request.slot) is request:
            del self.running[request.slot]
            with self._lock:
                heapq.heappush(self._free, request.slot)

    def decode_rows(self, requests: list[Request], scratch_position: int) -> tuple[list[int], list[int], int]:
        """Tokens and positions of slots 0..highest of ``requests`` (each feeds its latest token;
        other rows feed token 0 at ``scratch_position``) and the keys to read."""
        rows = max(r.slot for r in requests if r.slot is not None) + 1
        tokens, positions = [0] * rows, [scratch_position] * rows
        for r in requests:
            assert r.slot is not None and r.generated
            tokens[r.slot], positions[r.slot] = r.generated[-1], r.stored
        return tokens, positions, max(r.stored for r in requests) + 1
