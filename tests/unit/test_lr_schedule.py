"""Learning-rate / weight-decay schedules against values worked out by hand."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from megatrain.training.lr_schedule import (LRScheduleConfig, LRScheduler, ScheduleMismatch,
                                            lr_schedule_config_from_args)

LR, MIN_LR = 1.0e-3, 1.0e-4


def sched(style: str, **kw) -> LRScheduler:
    cfg = LRScheduleConfig(lr=LR, min_lr=MIN_LR, lr_decay_style=style, lr_decay_steps=1000,
                           lr_warmup_steps=100, **kw)
    return LRScheduler(None, cfg)


def test_warmup_is_linear_from_init():
    s = sched("cosine", lr_warmup_init=1.0e-5)
    assert s.get_lr(0) == pytest.approx(1.0e-5)
    assert s.get_lr(50) == pytest.approx(1.0e-5 + (LR - 1.0e-5) * 0.5)
    assert s.get_lr(100) == pytest.approx(LR)


@pytest.mark.parametrize("step,expected", [
    (0, 0.0), (50, 5.0e-4), (100, 1.0e-3),
    (550, 1.0e-4 + 0.5 * 9.0e-4),          # halfway through the decay
    (1000, 1.0e-4), (1001, 1.0e-4), (5000, 1.0e-4),
])
def test_linear(step, expected):
    assert sched("linear").get_lr(step) == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize("step,expected", [
    (0, 0.0), (50, 5.0e-4), (100, 1.0e-3),
    (325, 1.0e-4 + 9.0e-4 * 0.5 * (math.cos(math.pi * 0.25) + 1)),   # a quarter of the decay
    (550, 1.0e-4 + 9.0e-4 * 0.5),
    (1000, 1.0e-4), (2000, 1.0e-4),
])
def test_cosine(step, expected):
    assert sched("cosine").get_lr(step) == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize("step,expected", [(0, 0.0), (50, 5.0e-4), (100, 1.0e-3), (550, 1.0e-3), (10**6, 1.0e-3)])
def test_constant_ignores_decay_and_min_lr(step, expected):
    assert sched("constant").get_lr(step) == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize("step,expected", [
    (50, 5.0e-4), (100, 1.0e-3),
    (400, 1.0e-3 * 10 / 20),                 # sqrt(100) / sqrt(400)
    (900, 1.0e-3 * 10 / 30),
    (1000, max(1.0e-4, 1.0e-3 * 10 / math.sqrt(1000))),
    (1001, 1.0e-4),                          # past the decay: min lr
])
def test_inverse_square_root(step, expected):
    assert sched("inverse-square-root").get_lr(step) == pytest.approx(expected, abs=1e-15)


def test_inverse_square_root_floor_at_min_lr():
    s = LRScheduler(None, LRScheduleConfig(lr=1e-3, min_lr=5e-4, lr_decay_style="inverse-square-root",
                                           lr_decay_steps=1000, lr_warmup_steps=4))
    assert s.get_lr(16) == pytest.approx(1e-3 * 2 / 4)  # 5e-4: exactly at the floor
    assert s.get_lr(64) == pytest.approx(5e-4)                # formula gives 2.5e-4; floored
    # Without warmup the formula uses max(warmup, 1) and max(step, 1).
    s0 = LRScheduler(None, LRScheduleConfig(lr=1e-3, lr_decay_style="inverse-square-root", lr_decay_steps=1000))
    assert s0.get_lr(0) == pytest.approx(1e-3)
    assert s0.get_lr(4) == pytest.approx(5e-4)


@pytest.mark.parametrize("style,q_to_coeff", [
    ("linear", lambda q: 1 - q),
    ("cosine", lambda q: 0.5 * (math.cos(math.pi * q) + 1)),
    ("exponential", lambda q: 2 * 0.5 ** q - 1),
    ("minus_sqrt", lambda q: 1 - math.sqrt(q)),
])
def test_wsd(style, q_to_coeff):
    s = sched("WSD", lr_wsd_decay_style=style, lr_wsd_decay_steps=200)  # anneal over steps 800..1000
    assert s.get_lr(50) == pytest.approx(5.0e-4)
    assert s.get_lr(100) == pytest.approx(LR)
    assert s.get_lr(500) == pytest.approx(LR)          # stable phase
    assert s.get_lr(800) == pytest.approx(LR)          # last stable step
    for step in (850, 900, 950):
        q = (step - 800) / 200
        assert s.get_lr(step) == pytest.approx(MIN_LR + q_to_coeff(q) * (LR - MIN_LR), abs=1e-15)
    assert s.get_lr(1000) == pytest.approx(MIN_LR, abs=1e-15)
    assert s.get_lr(1200) == pytest.approx(MIN_LR)
    # Spot check with numbers written out: exponential halfway: 2 * 0.5**0.5 - 1 = 0.41421356...
    if style == "exponential":
        assert s.get_lr(900) == pytest.approx(1.0e-4 + 0.41421356237 * 9.0e-4)


def test_wsd_needs_decay_steps():
    with pytest.raises(ValueError, match="lr-wsd-decay-iters"):
        sched("WSD")


def test_weight_decay_increment():
    base = dict(lr=LR, lr_decay_steps=1000, start_weight_decay=0.0, end_weight_decay=0.1, wd_incr_steps=400)
    lin = LRScheduler(None, LRScheduleConfig(weight_decay_incr_style="linear", **base))
    assert lin.get_wd(0) == pytest.approx(0.0)
    assert lin.get_wd(100) == pytest.approx(0.025)
    assert lin.get_wd(400) == pytest.approx(0.1)
    assert lin.get_wd(401) == pytest.approx(0.1)
    cos = LRScheduler(None, LRScheduleConfig(weight_decay_incr_style="cosine", **base))
    assert cos.get_wd(0) == pytest.approx(0.0)
    assert cos.get_wd(200) == pytest.approx(0.05)
    assert cos.get_wd(100) == pytest.approx(0.1 * 0.5 * (math.cos(math.pi * 0.75) + 1))
    assert cos.get_wd(1000) == pytest.approx(0.1)
    const = LRScheduler(None, LRScheduleConfig(lr=LR, lr_decay_steps=1000, weight_decay=0.05))
    assert const.get_wd(0) == const.get_wd(999) == 0.05
    with pytest.raises(ValueError, match="start-weight-decay"):
        LRScheduleConfig(lr=LR, lr_decay_steps=10, start_weight_decay=0.0, end_weight_decay=0.1)


def _optimizer():
    w = torch.nn.Parameter(torch.zeros(2, 2))
    b = torch.nn.Parameter(torch.zeros(2))
    h = torch.nn.Parameter(torch.zeros(2, 2))
    return torch.optim.AdamW([
        {"params": [w], "wd_mult": 1.0, "lr_mult": 1.0},
        {"params": [b], "wd_mult": 0.0, "lr_mult": 1.0},
        {"params": [h], "wd_mult": 1.0, "lr_mult": 0.5, "max_lr": 2e-3, "default_config": False},
    ], lr=123.0)


def test_step_writes_param_groups_with_multipliers():
    opt = _optimizer()
    s = LRScheduler(opt, LRScheduleConfig(lr=LR, min_lr=0.0, lr_decay_steps=1000, lr_warmup_steps=100,
                                          weight_decay=0.1))
    # Constructor applied step 0: warmup starts at 0.
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0, 0.0]
    s.step(50)
    g0, g1, g2 = opt.param_groups
    assert g0["lr"] == pytest.approx(5e-4) and g1["lr"] == pytest.approx(5e-4)
    assert g2["lr"] == pytest.approx(0.5 * 1e-3)       # max_lr override 2e-3 halfway, times lr_mult 0.5
    assert (g0["weight_decay"], g1["weight_decay"], g2["weight_decay"]) == (0.1, 0.0, 0.1)
    assert s.current_lr() == pytest.approx(5e-4)
    s.step(500)  # 550: halfway through the linear decay
    assert g0["lr"] == pytest.approx(5e-4)
    assert g2["lr"] == pytest.approx(0.5 * 1e-3)


def _wsd_schedule() -> LRScheduler:
    cfg = LRScheduleConfig(lr=LR, min_lr=MIN_LR, lr_decay_style="WSD", lr_decay_steps=1000, lr_warmup_steps=37.5,
                           lr_wsd_decay_steps=300, lr_wsd_decay_style="cosine", start_weight_decay=0.0,
                           end_weight_decay=0.1, weight_decay_incr_style="linear", wd_incr_steps=900)
    a = LRScheduler(_optimizer(), cfg)
    for _ in range(37):
        a.step(23)
    return a


def test_state_dict_round_trip():
    a = _wsd_schedule()
    sd = a.state_dict()
    # Plain data only.
    assert all(isinstance(v, (int, float, str, type(None))) for v in sd.values())
    opt_b = _optimizer()
    b = LRScheduler(opt_b, LRScheduleConfig(lr=5.0, lr_decay_steps=10))  # another schedule: the checkpoint's taken
    notes = b.load_state_dict(sd, use_checkpoint=True)
    assert len(notes) == 1 and "--use-checkpoint-opt_param-scheduler" in notes[0] and "checkpoint 0.001, flags 5.0" \
        in notes[0]
    assert b.num_steps == 37 * 23
    assert b.state_dict() == sd
    for ga, gb in zip(a.optimizer.param_groups, opt_b.param_groups):
        assert ga["lr"] == gb["lr"] and ga["weight_decay"] == gb["weight_decay"]
    for step in (0, 700, 851, 1000):
        assert a.get_lr(step) == b.get_lr(step)
    # The same schedule: nothing to settle, no note.
    same = LRScheduler(_optimizer(), LRScheduleConfig(**{k: getattr(a.cfg, k) for k in (
        "lr", "min_lr", "lr_decay_style", "lr_decay_steps", "lr_warmup_steps", "lr_wsd_decay_steps",
        "lr_wsd_decay_style", "start_weight_decay", "end_weight_decay", "weight_decay_incr_style", "wd_incr_steps")}))
    assert same.load_state_dict(sd) == [] and same.num_steps == 37 * 23


def test_a_different_schedule_is_refused_one_line_per_value():
    """Megatron's default: every value the checkpoint holds must equal the flags'."""
    sd = _wsd_schedule().state_dict()
    cfg = LRScheduleConfig(lr=2 * LR, min_lr=MIN_LR, lr_decay_style="WSD", lr_decay_steps=2000,
                           lr_warmup_steps=37.5, lr_wsd_decay_steps=300, lr_wsd_decay_style="cosine",
                           start_weight_decay=0.0, end_weight_decay=0.1, weight_decay_incr_style="linear",
                           wd_incr_steps=900, flags={"lr_decay_steps": "--lr-decay-iters x --global-batch-size"},
                           iteration_samples=100)
    s = LRScheduler(_optimizer(), cfg)
    with pytest.raises(ScheduleMismatch) as e:
        s.load_state_dict(sd)
    lines = str(e.value).splitlines()
    assert lines[1:3] == ["  learning rate (--lr): checkpoint 0.001, flags 0.002",
                          "  decay length (--lr-decay-iters x --global-batch-size): checkpoint 1000 samples "
                          "(10 iterations), flags 2000 samples (20 iterations)"]
    assert len(lines) == 4 and "--override-opt_param-scheduler" in lines[3] \
        and "--use-checkpoint-opt_param-scheduler" in lines[3]
    assert s.num_steps == 0 and s.cfg.lr == 2 * LR  # nothing taken
    with pytest.raises(ValueError, match="only one of --override-opt_param-scheduler and --use-checkpoint"):
        s.load_state_dict(sd, use_checkpoint=True, override=True)


def test_override_keeps_the_flags_values_and_restores_the_step_count():
    """Megatron restores num_steps under --override-opt_param-scheduler too: warmup is not repeated."""
    sd = _wsd_schedule().state_dict()
    c = LRScheduler(_optimizer(), LRScheduleConfig(lr=5.0, lr_decay_steps=2000, lr_warmup_steps=100))
    notes = c.load_state_dict(sd, override=True)
    assert c.num_steps == 37 * 23 and c.cfg.lr == 5.0 and c.cfg.lr_decay_steps == 2000
    assert "--override-opt_param-scheduler" in notes[0] and "learning rate (--lr): checkpoint 0.001, flags 5.0" \
        in notes[0]
    assert c.current_lr() == pytest.approx(5.0 * (1 - (851 - 100) / 1900))  # past warmup, on the flags' decay


def test_group_bounds_follow_the_settled_schedule():
    """A loaded optimizer state brings the saved groups' max_lr/min_lr; apply_group_bounds puts the
    settled schedule's (default groups: --lr/--min-lr; decoupled: --decoupled-lr/--decoupled-min-lr)."""
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    from megatrain.optimizer import OptimizerConfig, build_optimizer
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3, min_lr=1e-4))
    s = LRScheduler(opt, LRScheduleConfig(lr=2e-3, min_lr=2e-4, lr_decay_steps=10, decoupled_lr=9e-3))
    opt.param_groups[0]["is_decoupled_lr"] = True  # as --decoupled-lr marks the embedding's group
    s.step(20)  # past the decay: min lr
    s.apply_group_bounds()
    assert opt.param_groups[0]["max_lr"] == 9e-3 and opt.param_groups[0]["min_lr"] == 2e-4
    assert [g["lr"] for g in opt.param_groups[1:]] == [2e-4] * (len(opt.param_groups) - 1)


def test_config_from_args_names_the_flags_of_each_length():
    cfg = lr_schedule_config_from_args(_args(train_iters=100))
    assert "--lr-decay-iters defaults to --train-iters" in cfg.flags["lr_decay_steps"]
    assert "--train-iters" in cfg.flags["wd_incr_steps"] and cfg.iteration_samples == 8
    cfg = lr_schedule_config_from_args(_args(train_iters=100, lr_decay_iters=50, decoupled_lr=1e-2))
    assert cfg.flags["lr_decay_steps"] == "--lr-decay-iters x --global-batch-size" and cfg.decoupled_lr == 1e-2


def _args(**kw):
    base = dict(train_iters=None, train_samples=None, global_batch_size=8, lr=1e-3, min_lr=0.0,
                lr_decay_style="cosine", lr_decay_iters=None, lr_decay_samples=None, lr_warmup_fraction=None,
                lr_warmup_iters=0, lr_warmup_samples=0, lr_warmup_init=0.0, lr_wsd_decay_style="exponential",
                lr_wsd_decay_iters=None, lr_wsd_decay_samples=None, weight_decay=0.01, start_weight_decay=None,
                end_weight_decay=None, weight_decay_incr_style="constant")
    base.update(kw)
    return argparse.Namespace(**base)


def test_config_from_iteration_args():
    cfg = lr_schedule_config_from_args(_args(train_iters=100, lr_warmup_iters=10))
    assert (cfg.lr_decay_steps, cfg.lr_warmup_steps, cfg.wd_incr_steps) == (800, 80, 800)
    assert cfg.start_weight_decay == cfg.end_weight_decay == 0.01
    cfg = lr_schedule_config_from_args(_args(train_iters=100, lr_decay_iters=50, lr_warmup_fraction=0.01,
                                             lr_decay_style="WSD", lr_wsd_decay_iters=20))
    assert cfg.lr_decay_steps == 400 and cfg.lr_warmup_steps == pytest.approx(4.0)
    assert cfg.lr_wsd_decay_steps == 160 and cfg.wd_incr_steps == 800
    with pytest.raises(ValueError, match="lr-warmup-fraction"):
        lr_schedule_config_from_args(_args(train_iters=100, lr_warmup_iters=10, lr_warmup_fraction=0.1))


def test_config_from_sample_args():
    cfg = lr_schedule_config_from_args(_args(train_samples=1000, lr_warmup_samples=30))
    assert (cfg.lr_decay_steps, cfg.lr_warmup_steps, cfg.wd_incr_steps) == (1000, 30, 1000)
    cfg = lr_schedule_config_from_args(_args(train_samples=1000, lr_decay_samples=600, lr_warmup_fraction=0.1))
    assert cfg.lr_decay_steps == 600 and cfg.lr_warmup_steps == pytest.approx(60.0)
    with pytest.raises(ValueError, match="lr-warmup-samples"):
        lr_schedule_config_from_args(_args(train_samples=1000, lr_warmup_samples=3, lr_warmup_fraction=0.1))
    with pytest.raises(ValueError, match="lr-decay-iters"):
        lr_schedule_config_from_args(_args(train_samples=1000, lr_decay_iters=3))
    with pytest.raises(ValueError, match="end-weight-decay"):
        lr_schedule_config_from_args(_args(train_samples=1000, weight_decay_incr_style="linear",
                                           start_weight_decay=0.0))


def test_warmup_must_be_shorter_than_decay():
    with pytest.raises(ValueError, match="warmup"):
        LRScheduleConfig(lr=LR, lr_decay_steps=100, lr_warmup_steps=100)


def test_values_that_do_not_act_are_not_compared():
    """The WSD anneal without a WSD style and --decoupled-min-lr without --decoupled-lr change
    nothing; Megatron's own values (here the weight-decay length, inert under a constant style)
    are compared as Megatron does."""
    saved = LRScheduler(None, LRScheduleConfig(lr=LR, lr_decay_steps=16_000_000, lr_wsd_decay_style="linear",
                                               decoupled_min_lr=1e-5)).state_dict()
    s = LRScheduler(None, LRScheduleConfig(lr=LR, lr_decay_steps=16_000_000, wd_incr_steps=8_000_000,
                                           iteration_samples=1000))
    with pytest.raises(ScheduleMismatch) as e:
        s.load_state_dict(saved)
    assert str(e.value).splitlines()[1:-1] == [
        "  weight-decay increment length (--train-iters/--train-samples): checkpoint 16000000 samples "
        "(16000 iterations), flags 8000000 samples (8000 iterations)"]
