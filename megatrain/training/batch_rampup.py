"""Global batch size ramp-up (``--rampup-batch-size START INCREMENT SAMPLES``), as Megatron-LM does it.

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
