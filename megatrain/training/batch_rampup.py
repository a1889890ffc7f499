"""Global batch sizes that change during a run, as Megatron-LM schedules them: the ramp-up
(``--rampup-batch-size START INCREMENT SAMPLES``, :class:`BatchRampup`) and the step-wise schedule
(``--step-batch-size-schedule "THRESHOLD:BATCH ..."``, :class:`StepBatchSchedule`). Both answer, from the
consumed-sample count, the global batch of the next iteration.

The ramp-up:

Training starts with a global batch of START samples and grows it by INCREMENT in equal steps over
the first SAMPLES consumed samples, up to ``--global-batch-size``: with
``n = (global - START) / INCREMENT`` steps, the batch after ``c`` consumed samples is
``START + INCREMENT * floor(c / (SAMPLES / n))``, and ``--global-batch-size`` once ``c`` exceeds
SAMPLES. The number of micro-batches per iteration follows it (the micro-batch size and the
data-parallel size stay fixed), the learning-rate schedule advances by the samples each iteration
consumed, and the position in the data is the consumed-sample count, so a resumed run continues
the ramp where it stopped. As in Megatron-LM, ramp-up needs sample-based training
(``--train-samples``); the iteration count is what the ramp implies.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchRampup:
    start: int
    increment: int
    samples: int
    global_batch_size: int
    micro_batch_times_dp: int  # --micro-batch-size x data-parallel size

    def __post_init__(self) -> None:
        flag = f"--rampup-batch-size {self.start} {self.increment} {self.samples}"
        if self.start <= 0 or self.increment <= 0 or self.samples < 0:
            raise ValueError(f"{flag}: the start and increment must be positive and the samples >= 0")
        if self.start > self.global_batch_size:
            raise ValueError(f"{flag}: the start exceeds --global-batch-size ({self.global_batch_size})")
        if (self.global_batch_size - self.start) % self.increment:
            raise ValueError(f"{flag}: --global-batch-size ({self.global_batch_size}) minus the start must be a "
                             "multiple of the increment")
        for what, value in (("start", self.start), ("increment", self.increment)):
            if value % self.micro_batch_times_dp:
                raise ValueError(f"{flag}: the {what} ({value}) must be a multiple of --micro-batch-size x "
                                 f"data-parallel size ({self.micro_batch_times_dp}), so that every batch of "
                                 "the ramp is whole micro-batches")

    @property
    def steps(self) -> int:
        return (self.global_batch_size - self.start) // self.increment

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples``."""
        if self.steps == 0 or self.samples == 0 or consumed_samples > self.samples:
            return self.global_batch_size
        per_step = self.samples / self.steps
        return min(self.start + self.increment * int(consumed_samples / per_step), self.global_batch_size)

    def micro_batches_at(self, consumed_samples: int) -> int:
        return self.global_batch_size_at(consumed_samples) // self.micro_batch_times_dp

    def iterations_for(self, train_samples: int) -> int:
        """Iterations of a ``--train-samples`` run (Megatron's count: the ramp's iterations, then
        whole global batches of what is left)."""
        consumed = iterations = 0
        while consumed <= self.samples and consumed <= train_samples:
            consumed += self.global_batch_size_at(consumed)
            iterations += 1
        return iterations + max(0, train_samples - consumed) // self.global_batch_size

    def describe(self) -> str:
        return (f"batch size ramp-up: global batch {self.start} growing by {self.increment} over the first "
                f"{self.samples:,} samples to {self.global_batch_size}")


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _count(text: str, entry: str, flag: str) -> int:
    """A count with an optional K/M/B/T suffix (``2.4B``), as Megatron-LM reads the schedule's values."""
    body = text.strip().upper()
    scale = _SUFFIXES.get(body[-1:], 1)
    if scale != 1:
        body = body[:-1]
    if not re.fullmatch(r"\d+(\.\d*)?|\.\d+", body):
        raise ValueError(f'{flag}: "{entry}": {text!r} is not a count (digits with an optional K, M, B or T)')
    return int(float(body) * scale)


@dataclass(frozen=True)
class StepBatchSchedule:
    """``--step-batch-size-schedule "0:16 2.4B:320 12B:1536"`` (Megatron-LM's step-wise schedule): from each
    threshold on, the global batch is that entry's. Thresholds count tokens and become samples by
    ``threshold // seq_length`` (Megatron-LM passes the sequence length); entries are separated by spaces or
    commas, sorted by threshold; the first threshold must be 0 and thresholds must increase strictly (after
    the conversion). Every batch must be whole micro-batches (``micro_batch_times_dp``). The last entry's
    batch is the run's ``--global-batch-size`` (the learning-rate schedule's iterations-to-samples unit)."""

    entries: tuple[tuple[int, int], ...]  # (threshold in samples, global batch), ascending
    micro_batch_times_dp: int

    FLAG = "--step-batch-size-schedule"

    @classmethod
    def parse(cls, text: str, seq_length: int | None, micro_batch_times_dp: int) -> "StepBatchSchedule":
        flag = cls.FLAG
        pairs = []
        for entry in text.replace(",", " ").split():
            if entry.count(":") != 1:
                raise ValueError(f'{flag}: "{entry}" is not THRESHOLD:BATCH_SIZE (e.g. "0:16 2.4B:320")')
            threshold, batch = (_count(part, entry, flag) for part in entry.split(":"))
            pairs.append((threshold // seq_length if seq_length else threshold, batch, entry))
        if not pairs:
            raise ValueError(f"{flag}: no THRESHOLD:BATCH_SIZE entries in {text!r}")
        pairs.sort(key=lambda p: p[0])
        if pairs[0][0] != 0:
            raise ValueError(f'{flag}: the first entry must start at threshold 0, got "{pairs[0][2]}"')
        for (a, _, ea), (b, _, eb) in zip(pairs, pairs[1:]):
            if b <= a:
                raise ValueError(f'{flag}: thresholds must increase: "{ea}" and "{eb}" are both {a} samples'
                                 + (f" (tokens // --seq-length {seq_length})" if seq_length else ""))
        for _, batch, entry in pairs:
            if batch <= 0 or batch % micro_batch_times_dp:
                raise ValueError(f'{flag}: "{entry}": the batch size must be a positive multiple of '
                                 f"--micro-batch-size x data-parallel size ({micro_batch_times_dp})")
        return cls(tuple((t, b) for t, b, _ in pairs), micro_batch_times_dp)

    @property
    def global_batch_size(self) -> int:
        return self.entries[-1][1]

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples``."""
        batch = self.entries[0][1]
        for threshold, size in self.entries:
            if consumed_samples < threshold:
                break
            batch = size
        return batch

    def micro_batches_at(self, consumed_samples: int) -> int:
        return self.global_batch_size_at(consumed_samples) // self.micro_batch_times_dp

    def iterations_for(self, train_samples: int) -> int:
        """Iterations of a ``--train-samples`` run (Megatron-LM's count: iterations until the consumed
        samples reach ``train_samples``)."""
        consumed = iterations = 0
        last_threshold, last = self.entries[-1]
        while consumed < train_samples and consumed < last_threshold:
            consumed += self.global_batch_size_at(consumed)
            iterations += 1
        return iterations + max(0, -(-(train_samples - consumed) // last))  # then whole last batches, rounded up

    def describe(self) -> str:
        return f"{self.FLAG}: global batch " + ", ".join(
            f"{batch} from {threshold:,} consumed samples" for threshold, batch in self.entries)


def batch_schedule_from_args(args: argparse.Namespace) -> BatchRampup | StepBatchSchedule | None:
    """The run's changing global batch (validated flags, the schedule one string: ``--rampup-batch-size`` or
    ``--step-batch-size-schedule``), or None for a constant one."""
    per_step = args.micro_batch_size * args.data_parallel_size
    schedule = getattr(args, "step_batch_size_schedule", None)
    if schedule is not None:
        return StepBatchSchedule.parse(schedule, args.seq_length, per_step)
    if args.rampup_batch_size:
        return BatchRampup(*args.rampup_batch_size, args.global_batch_size, per_step)
    return None
