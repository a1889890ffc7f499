"""CallOnlyEngine (the engine of encoder-decoder models) under tensor parallelism, 2 gloo CPU
processes: rank 0's calls reach rank 1 through the plan broadcast and run there in the same order with
the same JSON payload (a call doing a collective completes on both ranks), a failing call fails on
rank 0's future and the follower goes on, idle heartbeats keep the follower waiting, and close()
ends follow(); submit() refuses."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_harness import run_workers

from megatrain.inference.model_calls import CallOnlyEngine


def _worker(rank: int, world_size: int) -> dict[str, object]:
    group = dist.new_group(list(range(world_size)))
    engine = CallOnlyEngine(nn.Linear(2, 2), group=group, heartbeat_s=0.05)
    seen: list[object] = []

    def total(model, payload):  # a collective: only completes if every rank runs it
        seen.append(payload)
        value = torch.tensor([float(payload["x"]) * (dist.get_rank(group) + 1)])
        dist.all_reduce(value, group=group)
        return float(value)

    def fail(model, payload):
        seen.append("fail")
        raise ValueError("bad call")

    engine.register("total", total)
    engine.register("fail", fail)
    out: dict[str, object] = {}
    if rank == 0:
        try:
            with pytest.raises(ValueError, match="registered calls only"):
                engine.submit(None, None)
            with pytest.raises(ValueError, match="plain JSON"):
                engine.call("total", {"x": float("nan")})
            out["first"] = engine.call("total", {"x": 2, "t": (1, 2)}).result(60)
            time.sleep(0.3)  # idle: several heartbeats
            failed = engine.call("fail", {})
            out["error"] = str(failed.exception(60))
            out["second"] = engine.call("total", {"x": 3}).result(60)
        finally:
            engine.close()
        with pytest.raises(RuntimeError, match="closed"):
            engine.call("total", {"x": 1})
    else:
        with pytest.raises(RuntimeError, match="rank 0"):
            engine.call("total", {"x": 1})
        engine.follow()
    out["seen"] = seen
    return out


@pytest.mark.slow
def test_call_only_engine_runs_calls_on_every_rank():
    ranks = run_workers(_worker, 2)
    assert ranks[0]["first"] == 2 * 1 + 2 * 2 and ranks[0]["second"] == 3 * 1 + 3 * 2
    assert ranks[0]["error"] == "bad call"
    want = [{"x": 2, "t": [1, 2]}, "fail", {"x": 3}]  # the payload as JSON: a tuple arrives as a list
    assert ranks[0]["seen"] == ranks[1]["seen"] == want


def test_call_only_engine_in_one_process():
    engine = CallOnlyEngine(nn.Linear(2, 2))
    engine.register("echo", lambda model, payload: (model.training, payload))
    try:
        assert engine.call("echo", {"a": 1}).result(10) == (False, {"a": 1})
        with pytest.raises(ValueError, match="no function registered"):
            engine.call("missing", {})
        with pytest.raises(RuntimeError, match="follow"):
            engine.follow()
    finally:
        engine.close()
