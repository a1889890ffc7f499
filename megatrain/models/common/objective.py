"""Objectives: what a family trains for. An objective owns turning the loader's samples into a typed
micro-batch, calling the model on it, the losses as (sum, count) pairs, and the names they are
logged under (Megatron's ``lm loss``; BERT adds ``sop loss``; mixture-of-experts its balancing
losses).

The training loop, evaluation and the pipeline schedule use only this interface:

* ``host_batch(samples)`` (optional): the loader's collated samples still on the host, reshaped
  before they move (work whose shapes follow from the data's values, which on the device would make
  the host wait for it); the samples unchanged by default (an objective that reshapes here keeps
  ``batches_in_cuda_graph`` False: a recorded micro-batch replays ``make_batch`` on the raw samples);
* ``make_batch(samples)``: the micro-batch (a :class:`megatrain.data.batch.Batch`) from the
  loader's collated samples already on the device;
* ``forward(model, batch)``: the model's output for the batch (per-token losses, or whatever
  ``losses`` reads) under the caller's autocast;
* ``loss_target(batch)``: the tensor the loss needs besides the output (a loss mask); under
  pipeline parallelism it travels to the last stage with the schedule's micro-batches;
* ``losses(output, target)``: one (sum, count) pair per name in ``loss_names``. A micro-batch's
  loss is the sum of the means ``sum / count`` (counts summed over context-parallel ranks);
  logged losses are those means averaged over micro-batches and data-parallel ranks;
* ``stage_inputs(batch, first=, last=)``: the positional and keyword arguments of a pipeline
  stage (the first stage's input, the tensors every stage reads, the labels of the last).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Objective", "loss_means"]


class Objective:
    """Base class: subclasses set ``loss_names`` and implement the five methods (``host_batch`` optional)."""

    loss_names: tuple[str, ...] = ()
    # Whether make_batch is device work only (no host synchronisation), so that a CUDA graph of the
    # micro-batch can hold it (--cuda-graph-impl local).
    batches_in_cuda_graph: bool = True
    # Whether forward hands the model labels that are mostly IGNORE (-100): an image's positions, a prompt.
    # The trainer then has the chunked loss head compute the labeled rows alone (fused_loss, labeled_rows_only).
    sparse_labels: bool = False

    def host_batch(self, samples: Any) -> Any:
        return samples

    def make_batch(self, samples: Any) -> Any:
        raise NotImplementedError

    def forward(self, model: Any, batch: Any) -> Any:
        raise NotImplementedError

    def loss_target(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def losses(self, output: Any, target: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def stage_inputs(self, batch: Any, *, first: bool, last: bool) -> tuple[tuple, dict[str, Any]]:
        raise NotImplementedError


def loss_means(loss_sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each loss's mean: its sum over its count (at least 1); vectors with one entry per loss name."""
    return loss_sums / counts.clamp(min=1.0)
