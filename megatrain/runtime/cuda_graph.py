"""CUDA graphs of the training micro-batch (``--cuda-graph-impl local``, Megatron's flag; also
``--enable-cuda-graph``): the host records one micro-batch's work -- the batch built from its
token ids, forward, loss, backward and the gradients' accumulation -- once, then launches it as one
graph per micro-batch. A small model's step otherwise waits for the host, which launches its
~2,500 kernels no faster than the GPU runs them.

What makes one recording valid for every later micro-batch, and how it is kept so:

* **Fixed addresses.** The token ids are copied into one device buffer before each replay; every
  parameter's gradient is allocated before the recording and zeroed in place at the start of each
  iteration (never freed), so the recorded backward always accumulates into the same tensors the
  optimizer reads. The gradient-accumulation fusion's half-precision weights are refreshed in place.
* **No host decisions inside.** The loss weight of a micro-batch is a constant of the recording
  (one recording per weight: it changes only with ``--rampup-batch-size``); dynamic loss scaling
  (``--fp16``) is refused, since its scale changes at run time.
* **Warm-up first.** The first ``--cuda-graph-warmup-steps`` iterations run as usual, on the stream
  the recording uses (compilation, cuBLAS and autograd set themselves up there); random numbers
  (dropout) advance on every replay as torch's graph-safe generator provides.

The loop calls :meth:`MicroBatchGraphs.begin_iteration` where it would clear the gradients and
:meth:`MicroBatchGraphs.run` for each micro-batch. What the graph cannot hold -- pipeline
schedules, collectives of tensor/context/data parallelism, checkpointed recomputation -- is refused
when the flags are checked (``arguments.py``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

__all__ = ["MicroBatchGraphs"]

# fn(samples on the device, loss weight, totals) runs one micro-batch: forward and backward, adding
# its losses into totals[0] and their loss-token counts into totals[1].
MicroBatchFn = Callable[[torch.Tensor, float, torch.Tensor], None]


class MicroBatchGraphs:
    """Records one training micro-batch as a CUDA graph after ``warmup_iterations`` and replays it."""

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device, warmup_iterations: int,
                 num_losses: int = 1) -> None:
        assert device.type == "cuda", "CUDA graphs need a CUDA device"
        self.params = [p for p in params if p.requires_grad]
        self.device = device
        self.warmup_left = warmup_iterations
        self.stream = torch.cuda.Stream(device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.weight: float | None = None  # the loss weight recorded in the graph
        self.samples: torch.Tensor | None = None  # the recorded micro-batch's input buffer
        # Per loss: the sum of the micro-batch losses and their loss-token count, over the iteration.
        self.totals = torch.zeros(2, num_losses, device=device)
        # The gradients the graph accumulates into, held as aliases (other tensor objects on the same
        # memory): autograd takes a gradient tensor over as ``.grad`` without a copy only while nothing
        # else refers to that tensor object (the gradient-accumulation fusion relies on it).
        self.grads: list[torch.Tensor] = []
        self.recordings = 0

    @property
    def warming_up(self) -> bool:
        return self.warmup_left > 0

    def begin_iteration(self, clear_grads: Callable[[], None]) -> None:
        """Start an iteration: during warm-up ``clear_grads()`` (the usual way); afterwards the
        gradients the graph writes are zeroed in place, and the iteration's totals too."""
        if self.warming_up:
            clear_grads()
            return
        if not self.grads:  # the first recorded iteration: fixed gradient tensors from now on
            clear_grads()
            for p in self.params:
                p.grad = torch.zeros_like(p)
            self.grads = [p.grad.detach() for p in self.params]
        else:
            torch._foreach_zero_(self.grads)
        self.totals.zero_()

    def end_iteration(self) -> None:
        if self.warming_up:
            self.warmup_left -= 1

    @contextlib.contextmanager
    def warmup_stream(self) -> Iterator[None]:
        """Run the enclosed (warm-up) micro-batches on the recording's stream."""
        if not self.warming_up:
            yield
            return
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def run(self, samples: torch.Tensor, weight: float, fn: MicroBatchFn) -> None:
        """One micro-batch after the warm-up: copy ``samples`` into the recorded buffer and replay
        (recording first when there is no graph for ``weight`` yet)."""
        assert not self.warming_up and self.grads, "begin_iteration() first, after the warm-up"
        if self.graph is None or self.weight != weight or self.samples is None \
                or self.samples.shape != samples.shape:
            self._record(samples, weight, fn)
        assert self.samples is not None and self.graph is not None
        self.samples.copy_(samples, non_blocking=True)
        self.graph.replay()

    def _gather_grads(self) -> None:
        """(Recorded after the backward.) The micro-batch's backward leaves each gradient in its
        fixed tensor (autograd adds in place; the gradient-accumulation fusion returns the updated
        tensor and its held gradients are added back into theirs), except where autograd summed a
        weight's gradient from several uses (a tied embedding and output layer) into a new tensor:
        that one is copied into the fixed tensor."""
        for p, g in zip(self.params, self.grads):
            if p.grad is None:  # unused in this micro-batch: its gradient stays what it was
                p.grad = g
            elif p.grad.data_ptr() != g.data_ptr():
                g.copy_(p.grad)
                p.grad = g

    def _record(self, samples: torch.Tensor, weight: float, fn: MicroBatchFn) -> None:
        self.graph = None  # an older recording (another loss weight) and its memory go first
        self.samples = torch.empty(samples.shape, dtype=samples.dtype, device=self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the data loader's pinning thread may call CUDA while the host records
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                fn(self.samples, weight, self.totals)
                self._gather_grads()
        except RuntimeError as e:
            raise RuntimeError(f"--cuda-graph-impl local: recording the training micro-batch as a CUDA graph "
                               f"failed ({e}); train without CUDA graphs (leave out --cuda-graph-impl / "
                               f"--enable-cuda-graph)") from e
        self.graph, self.weight = graph, weight
        self.recordings += 1
