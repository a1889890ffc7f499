"""MicroBatchGraphs on a GPU: replays accumulate into the fixed gradients exactly as the micro-batch
run kernel by kernel (also for a weight autograd sums from two uses), every iteration starts from
zero, and dropout draws a new mask on every replay. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatrain.runtime.cuda_graph import MicroBatchGraphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _setup():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    w = nn.Parameter(torch.randn(8, 8, device=dev) / 3)
    b = nn.Parameter(torch.randn(8, device=dev))

    def fn(samples: torch.Tensor, weight: float, totals: torch.Tensor) -> None:
        x = samples.float()
        loss = ((x @ w) @ w.t() + b).square().mean()  # w used twice: autograd sums two gradients
        totals[0] += loss.detach()
        (loss * weight).backward()

    return dev, w, b, fn


def _reference(w: torch.Tensor, b: torch.Tensor, batches: list[torch.Tensor], weight: float):
    w2, b2 = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    total = 0.0
    for s in batches:
        loss = ((s.cuda().float() @ w2) @ w2.t() + b2).square().mean()
        total += loss.item()
        (loss * weight).backward()
    return w2.grad, b2.grad, total


def test_replays_accumulate_like_the_micro_batches_run_kernel_by_kernel():
    dev, w, b, fn = _setup()
    graphs = MicroBatchGraphs([w, b], dev, warmup_iterations=1)
    data = [torch.randn(4, 8) for _ in range(9)]
    weight = 1 / 3
    graphs.begin_iteration(lambda: setattr(w, "grad", None) or setattr(b, "grad", None))
    with graphs.warmup_stream():  # iteration 1: run as usual, on the recording's stream
        scratch = torch.zeros(2, device=dev)
        for s in data[:3]:
            fn(s.to(dev), weight, scratch)
    graphs.end_iteration()
    assert not graphs.warming_up
    ref_w, ref_b, _ = _reference(w, b, data[:3], weight)
    torch.testing.assert_close(w.grad, ref_w)
    for it in (1, 2):  # recorded in the first, replayed in both: each starts from zero
        batches = data[3 * it:3 * it + 3]
        graphs.begin_iteration(lambda: None)
        for s in batches:
            graphs.run(s, weight, fn)
        graphs.end_iteration()
        ref_w, ref_b, ref_total = _reference(w, b, batches, weight)
        torch.testing.assert_close(w.grad, ref_w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.grad, ref_b, rtol=1e-5, atol=1e-6)
        assert graphs.totals[0].item() == pytest.approx(ref_total, rel=1e-5)
    assert graphs.recordings == 1
    graphs.begin_iteration(lambda: None)  # another loss weight (batch ramp-up): recorded again
    graphs.run(data[0], 0.5, fn)
    assert graphs.recordings == 2


def test_dropout_draws_a_new_mask_on_every_replay():
    dev = torch.device("cuda")
    w = nn.Parameter(torch.ones(64, 64, device=dev))
    out = torch.zeros(64, 64, device=dev)

    def fn(samples: torch.Tensor, weight: float, totals: torch.Tensor) -> None:
        y = F.dropout(samples.float() @ w, p=0.5, training=True)
        out.copy_(y.detach())
        (y.sum() * weight).backward()

    graphs = MicroBatchGraphs([w], dev, warmup_iterations=1)
    graphs.begin_iteration(lambda: None)
    with graphs.warmup_stream():
        fn(torch.ones(64, 64, device=dev), 1.0, graphs.totals)
    graphs.end_iteration()
    graphs.begin_iteration(lambda: None)
    masks = []
    for _ in range(3):
        graphs.run(torch.ones(64, 64), 1.0, fn)
        masks.append(out != 0)
    assert all(0.4 < m.float().mean().item() < 0.6 for m in masks)
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
