"""What the training loop does between steps besides training: Python garbage collection on a schedule
(``--manual-gc``), releasing cached CUDA memory (``--empty-unused-memory-level``) and a profiler
window (``--profile``).

* ``--manual-gc`` turns Python's automatic collector off for the run (its pauses land at random
  points and, across many ranks, stall collectives) and collects at start, every
  ``--manual-gc-interval`` iterations, and before and after each evaluation (unless
  ``--no-manual-gc-eval``).
* ``--empty-unused-memory-level 1`` returns cached, unused CUDA memory to the device after every
  step's forward/backward and after evaluation; ``2`` also after the optimizer step.
* ``--profile`` records iterations ``--profile-step-start`` up to ``--profile-step-end`` on the ranks of
  ``--profile-ranks`` with ``torch.profiler`` (CPU and, on GPUs, CUDA activity) and writes a Chrome /
  Perfetto trace ``trace_rank{R}_iters{START}-{END}.json`` into ``--profile-dir`` (default
  ``--tensorboard-dir``, else ``./profile``).
* ``--record-memory-history`` (CUDA) records the caching allocator's allocations and frees, with their Python
  stacks, from start-up (before the model is built) on the ranks of ``--profile-ranks``, and at every log line
  writes a snapshot to ``--memory-snapshot-path`` with the rank before the extension (Megatron-LM's naming:
  ``snapshot_0.pickle``), for https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
from typing import Iterator

import torch

from megatrain.atomic_io import atomic_path


class Housekeeping:
    """Hooks the trainer calls at fixed points of the loop; each does nothing unless its flag is set."""

    def __init__(self, args: argparse.Namespace, device: torch.device, rank: int) -> None:
        self.manual_gc = bool(getattr(args, "manual_gc", False))
        self.gc_interval = int(getattr(args, "manual_gc_interval", 0) or 0)
        self.gc_eval = bool(getattr(args, "manual_gc_eval", True))
        self.empty_level = int(getattr(args, "empty_unused_memory_level", 0) or 0)
        self.cuda = device.type == "cuda"
        self.rank = rank
        self.profile = bool(getattr(args, "profile", False)) and rank in list(getattr(args, "profile_ranks", [0]))
        self.profile_start = int(getattr(args, "profile_step_start", 10))
        self.profile_end = int(getattr(args, "profile_step_end", 12))
        self.profile_dir = (getattr(args, "profile_dir", None) or getattr(args, "tensorboard_dir", None)
                            or "profile")
        self._profiler: torch.profiler.profile | None = None
        self.trace_path: str | None = None
        self.snapshot_path: str | None = None  # where --record-memory-history writes (None: not recording)
        if self.cuda and getattr(args, "record_memory_history", False) and \
                rank in list(getattr(args, "profile_ranks", [0])):  # (on a CPU the flag's note says why not)
            base, ext = os.path.splitext(getattr(args, "memory_snapshot_path", None) or "snapshot.pickle")
            self.snapshot_path = f"{base}_{rank}{ext}"
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        if self.gc_interval < 0:
            raise ValueError(f"--manual-gc-interval must be >= 0, got {self.gc_interval}")
        if getattr(args, "profile", False) and not 0 <= self.profile_start < self.profile_end:
            raise ValueError(f"--profile needs 0 <= --profile-step-start ({self.profile_start}) < "
                             f"--profile-step-end ({self.profile_end})")

    # ---- the loop's fixed points ----------------------------------------------------------------
    def start(self) -> None:
        if self.manual_gc:
            gc.disable()
            gc.collect()

    def before_iteration(self, completed: int) -> None:
        """``completed``: iterations finished so far (the profiler window counts them)."""
        if self.profile and completed == self.profile_start and self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()
        if self.profile and completed == self.profile_end:
            self._stop_profiler()

    def after_forward_backward(self) -> None:
        if self.empty_level >= 1 and self.cuda:
            torch.cuda.empty_cache()

    def after_optimizer_step(self, completed: int) -> None:
        if self.empty_level >= 2 and self.cuda:
            torch.cuda.empty_cache()
        if self.manual_gc and self.gc_interval and completed % self.gc_interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def around_evaluation(self) -> Iterator[None]:
        if self.manual_gc and self.gc_eval:
            gc.collect()
        try:
            yield
        finally:
            if self.manual_gc and self.gc_eval:
                gc.collect()
            if self.empty_level >= 1 and self.cuda:
                torch.cuda.empty_cache()

    def after_log(self) -> None:
        """At a log line: the memory snapshot (``--record-memory-history``), replacing the last one whole."""
        if self.snapshot_path is None:
            return
        folder = os.path.dirname(self.snapshot_path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with atomic_path(self.snapshot_path) as tmp:
            torch.cuda.memory._dump_snapshot(tmp)

    def close(self) -> None:
        self._stop_profiler()
        if self.snapshot_path is not None:
            self.after_log()
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot_path = None
        if self.manual_gc:
            gc.enable()

    # ---- the profiler ---------------------------------------------------------------------------
    def _stop_profiler(self) -> None:
        if self._profiler is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self._profiler.stop()
        os.makedirs(self.profile_dir, exist_ok=True)
        path = os.path.join(self.profile_dir,
                            f"trace_rank{self.rank}_iters{self.profile_start}-{self.profile_end}.json")
        with atomic_path(path) as tmp:
            self._profiler.export_chrome_trace(tmp)
        self._profiler = None
        self.trace_path = path
        print(f" [rank {self.rank}] profiler trace of iterations {self.profile_start + 1}-{self.profile_end} "
              f"written to {path}", flush=True)
