"""Loss scaling (Megatron's DynamicGradScaler rules) and the inf/nan gradient checks."""

from __future__ import annotations

import math

import pytest
import torch

from megatrain.training.loss_scaler import (
    ConstantLossScaler,
    DynamicLossScaler,
    build_loss_scaler,
    found_inf_in_grads,
    reduce_found_inf,
    unscale_grads_,
)


def test_backoff_only_after_hysteresis_overflows():
    s = DynamicLossScaler(initial_scale=2.0**16, hysteresis=3, growth_interval=100)
    s.update(True)
    s.update(True)
    assert s.scale == 2.0**16          # two overflows: hysteresis 3 not used up
    assert s.hysteresis_tracker == 1
    s.update(True)
    assert s.scale == 2.0**15          # third: back off
    s.update(True)
    assert s.scale == 2.0**14          # hysteresis exhausted: every further overflow backs off


def test_clean_steps_do_not_restore_hysteresis_until_growth():
    s = DynamicLossScaler(initial_scale=1024.0, hysteresis=2, growth_interval=3)
    s.update(True)                      # hysteresis 2 -> 1
    s.update(False)
    s.update(False)                     # growth tracker 2, not yet growth
    assert (s.growth_tracker, s.hysteresis_tracker, s.scale) == (2, 1, 1024.0)
    s.update(True)                      # tracker 1 -> 0: back off now; growth tracker resets
    assert (s.growth_tracker, s.hysteresis_tracker, s.scale) == (0, 0, 512.0)
    for _ in range(3):
        s.update(False)                 # three clean steps in a row: grow, reset both trackers
    assert (s.growth_tracker, s.hysteresis_tracker, s.scale) == (0, 2, 1024.0)
    s.update(True)
    assert s.scale == 1024.0            # hysteresis restored by the growth


def test_growth_after_interval_of_clean_steps():
    s = DynamicLossScaler(initial_scale=4.0, growth_interval=5)
    for _ in range(4):
        s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0 and s.growth_tracker == 0
    for _ in range(10):
        s.update(False)
    assert s.scale == 32.0
    # An overflow in the middle restarts the count.
    for _ in range(4):
        s.update(False)
    s.update(True)
    for _ in range(4):
        s.update(False)
    assert s.scale == 32.0
    s.update(False)
    assert s.scale == 64.0


def test_min_scale_floor():
    s = DynamicLossScaler(initial_scale=8.0, min_scale=2.0, hysteresis=1, growth_interval=1000)
    for _ in range(10):
        s.update(True)
    assert s.scale == 2.0
    s2 = DynamicLossScaler(initial_scale=8.0, min_scale=3.0, hysteresis=1)
    s2.update(True)
    s2.update(True)
    assert s2.scale == 3.0              # max(4*0.5, 3)


def test_megatron_defaults():
    s = DynamicLossScaler()
    assert (s.scale, s.min_scale, s.growth_factor, s.backoff_factor, s.growth_interval, s.hysteresis) == (
        2.0**32, 1.0, 2.0, 0.5, 1000, 2)


def test_scale_is_rounded_to_float32():
    s = DynamicLossScaler(initial_scale=1000.1, growth_interval=1)
    assert s.scale == float(torch.tensor(1000.1, dtype=torch.float32))
    s.update(False)
    assert s.scale == float(torch.tensor(1000.1, dtype=torch.float32) * 2)


def test_state_round_trip():
    a = DynamicLossScaler(initial_scale=2.0**20, growth_interval=7, hysteresis=3)
    for found in (True, False, False, True, True, False):
        a.update(found)
    sd = a.state_dict()
    assert sd == {"scale": 2.0**19, "growth_tracker": 1, "hysteresis_tracker": 0}
    b = DynamicLossScaler(initial_scale=2.0**20, growth_interval=7, hysteresis=3)
    b.load_state_dict(sd)
    for found in (False, True, False, False):
        a.update(found)
        b.update(found)
        assert a.state_dict() == b.state_dict()
    # A Megatron checkpoint stores the scale as a tensor.
    c = DynamicLossScaler()
    c.load_state_dict({"scale": torch.tensor([256.0]), "growth_tracker": 3, "hysteresis_tracker": 1})
    assert c.state_dict() == {"scale": 256.0, "growth_tracker": 3, "hysteresis_tracker": 1}


def test_constant_scaler_and_builder():
    c = ConstantLossScaler(128.0)
    c.update(True)
    assert c.scale == 128.0 and c.inv_scale == 1 / 128 and c.state_dict() == {}
    assert isinstance(build_loss_scaler(fp16=True), DynamicLossScaler)
    assert isinstance(build_loss_scaler(fp16=True, loss_scale=4.0), ConstantLossScaler)
    assert isinstance(build_loss_scaler(fp16=False, loss_scale=4.0), ConstantLossScaler)
    assert build_loss_scaler(fp16=False) is None
    with pytest.raises(ValueError, match="hysteresis"):
        DynamicLossScaler(hysteresis=0)


def _params(*grads):
    ps = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        ps.append(p)
    return ps


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unscale_finds_non_finite(bad):
    ps = _params(torch.tensor([2.0, 4.0]), torch.tensor([8.0, bad], dtype=torch.float16), torch.ones(3))
    found = unscale_grads_(ps, 0.5)
    assert found.dim() == 0 and found.dtype == torch.float32 and found.item() == 1.0
    assert torch.equal(ps[0].grad, torch.tensor([1.0, 2.0]))


def test_unscale_clean_grads():
    ps = _params(torch.tensor([2.0, 4.0]), torch.tensor([8.0], dtype=torch.bfloat16))
    ps.append(torch.nn.Parameter(torch.zeros(2)))  # no grad: skipped
    found = unscale_grads_(ps, torch.tensor(0.25))
    assert found.item() == 0.0
    assert torch.equal(ps[0].grad, torch.tensor([0.5, 1.0]))
    assert ps[1].grad.item() == 2.0 and ps[1].grad.dtype == torch.bfloat16


def test_unscale_fallback_without_fused_kernel(monkeypatch):
    monkeypatch.delattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
    ps = _params(torch.tensor([2.0, float("nan")]), torch.tensor([4.0]))
    assert unscale_grads_(ps, 0.5).item() == 1.0
    assert ps[1].grad.item() == 2.0
    ps = _params(torch.tensor([2.0, 6.0]))
    assert unscale_grads_(ps, 0.5).item() == 0.0
    assert torch.equal(ps[0].grad, torch.tensor([1.0, 3.0]))


def test_found_inf_in_grads_leaves_grads_alone():
    clean = _params(torch.tensor([1.0, -3.0]), torch.full((4,), 60000.0, dtype=torch.float16))
    assert found_inf_in_grads(clean).item() == 0.0     # fp16 values whose squares overflow fp16
    assert torch.equal(clean[0].grad, torch.tensor([1.0, -3.0]))
    for bad in (math.inf, -math.inf, math.nan):
        ps = _params(torch.ones(3), torch.tensor([0.0, bad], dtype=torch.bfloat16))
        found = found_inf_in_grads(ps)
        assert found.dim() == 0 and found.item() == 1.0
    assert found_inf_in_grads([]).item() == 0.0


def test_reduce_found_inf_without_distributed_is_identity():
    t = torch.tensor(1.0)
    assert reduce_found_inf(t) is t and t.item() == 1.0


def test_dtensor_grads_are_checked_and_unscaled_on_local_shards(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
        w.grad = distribute_tensor(torch.full((4, 2), 8.0), mesh, [Shard(0)])
        assert found_inf_in_grads([w]).item() == 0.0
        found = reduce_found_inf(unscale_grads_([w], 0.25))
        assert found.item() == 0.0
        assert torch.equal(w.grad.full_tensor(), torch.full((4, 2), 2.0))
        w.grad = distribute_tensor(torch.tensor([[1.0, math.nan]] * 4), mesh, [Shard(0)])
        assert found_inf_in_grads([w]).item() == 1.0
        assert reduce_found_inf(unscale_grads_([w], 0.5)).item() == 1.0
    finally:
        dist.destroy_process_group()
