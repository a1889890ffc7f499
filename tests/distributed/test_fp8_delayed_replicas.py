"""Delayed fp8 scaling under data parallelism (DDP=2, gloo, the real trainer with Megatron's fp8
flags): each replica records its own micro-batches' amaxes, and after every optimizer step all
replicas hold the same histories (their elementwise maximum) and the scales computed from them; a
run stopped and resumed from its checkpoint then continues with the same losses on every rank."""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

from dist_harness import run_workers
from test_checkpoint_resume import BASE, HALF, run_trainer

pytestmark = pytest.mark.slow

FP8 = ["--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "3", "--fp8-amax-compute-algo", "max",
       "--no-torch-compile", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _states(layers) -> list[torch.Tensor]:
    return [t.clone() for m in layers for t in (m.scale_in, m.amax_state_in, m.scale_grad, m.amax_state_grad)]


def _worker(rank: int, world: int, root: str) -> dict:
    from megatrain.training.arguments import parse_args
    from megatrain.training.trainer import Trainer

    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(parse_args([*BASE, *FP8]))
    try:
        scaling = trainer.fp8_scaling
        assert scaling is not None and scaling.replicas == 2
        before: list[list[torch.Tensor]] = []
        sync = scaling.after_backward

        def recorded() -> None:
            before.append(_states(scaling.layers))
            sync()
        scaling.after_backward = recorded
        after = []
        for _ in range(2):
            trainer.train_step()
            after.append(_states(scaling.layers))
    finally:
        trainer.close()
    save = os.path.join(root, "ckpt")
    full, _ = run_trainer([*BASE, *FP8])
    first, _ = run_trainer([*BASE, *FP8, "--save", save, "--exit-interval", str(HALF)])
    second, _ = run_trainer([*BASE, *FP8, "--load", save])
    return {"before": before, "after": after, "full": full, "resumed": first + second}


def test_replicas_agree_after_each_step_and_resume_exactly(tmp_path):
    pytest.importorskip("torchao.float8")
    ranks = run_workers(_worker, 2, str(tmp_path))
    for step in range(2):
        mine, theirs = ranks[0]["before"][step], ranks[1]["before"][step]
        # each replica saw other micro-batches: their histories differ before the step's agreement
        assert any(not torch.equal(a, b) for a, b in zip(mine[1::2], theirs[1::2])), step
        for a, b, merged, merged_1 in zip(mine, theirs, ranks[0]["after"][step], ranks[1]["after"][step]):
            assert torch.equal(merged, merged_1), step
            if a.dim() == 1:  # [next scale, history]: the history is the elementwise maximum
                assert torch.equal(merged[1:], torch.maximum(a[1:], b[1:])), step
        for i in range(0, len(mine), 2):  # each scale from the merged history's maximum (algo max, margin 0)
            scale, state = ranks[0]["after"][step][i], ranks[0]["after"][step][i + 1]
            fmax = 448.0 if (i // 2) % 2 == 0 else 57344.0  # inputs e4m3, output gradients e5m2 (hybrid)
            want = torch.tensor(fmax / state[1:].max().double().item(), dtype=torch.float32)
            assert torch.equal(scale, want) and torch.equal(state[0], want), (step, i)
    last = ranks[-1]  # the training lines come from the last rank
    assert [it for it, _, _ in last["full"]] == list(range(1, 7))
    assert last["resumed"] == last["full"]
