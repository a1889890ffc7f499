"""Learning-rate and weight-decay schedules with Megatron-LM's semantics.

Steps are counted in **samples**, as Megatron does: the training loop calls
``scheduler.step(increment=global_batch_size)`` after every successful (not
skipped) iteration, and the warmup/decay lengths in :class:`LRScheduleConfig`
are sample counts. ``lr_schedule_config_from_args`` converts Megatron's
``--lr-*-iters`` flags to samples (iterations * global batch size) and takes
``--lr-*-samples`` as they are under ``--train-samples``.

Learning rate at step ``n`` (samples consumed), with ``W`` warmup steps and
``D`` decay steps:

* ``W > 0 and n <= W``: linear from ``lr_warmup_init`` to the group's max lr;
* ``constant`` style: the max lr forever after warmup;
* ``n > D``: ``min_lr``;
* ``inverse-square-root``: ``max(min_lr, max_lr * sqrt(max(W, 1)) / sqrt(max(n, 1)))``;
* otherwise ``min_lr + coeff * (max_lr - min_lr)`` with ``r = (n - W) / (D - W)`` and
  ``coeff`` = ``1 - r`` (linear), ``(cos(pi r) + 1) / 2`` (cosine) or, for ``WSD``,
  1 until the last ``lr_wsd_decay_steps`` steps and then, with ``q`` the fraction of
  that anneal done: ``1 - q`` (linear), ``(cos(pi q) + 1) / 2`` (cosine),
  ``2 * 0.5**q - 1`` (exponential), ``1 - sqrt(q)`` (minus_sqrt).

Weight decay goes from ``start_weight_decay`` to ``end_weight_decay`` over
``wd_incr_steps`` steps (constant, linear or cosine) and is multiplied by each
parameter group's ``wd_mult`` (0 for biases and norm weights).

Per parameter group, ``max_lr`` / ``min_lr`` / ``start_wd`` / ``end_wd`` keys
override the schedule's values (Megatron's parameter-group overrides) and an
``lr_mult`` key (Megatron's older per-group multiplier) scales the result.

Resuming (:meth:`LRScheduler.load_state_dict`) follows Megatron-LM's
``OptimizerParamScheduler``: the step count always comes from the checkpoint; every
schedule value the checkpoint holds must equal the flags' unless
``--use-checkpoint-opt_param-scheduler`` (the checkpoint's values win) or
``--override-opt_param-scheduler`` (the flags' values win) says which side to take.
Megatron's state holds the peak and minimum lr, warmup and decay lengths, decay style
and the weight-decay schedule; megatrain's also holds ``--lr-warmup-init``, the WSD
anneal and ``--decoupled-lr``/``--decoupled-min-lr``, compared the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


class ScheduleMismatch(ValueError):
    """The checkpoint's learning-rate schedule cannot be taken with the flags (the message says why)."""


@dataclass
class LRScheduleConfig:
    """Schedule parameters; every ``*_steps`` is counted in samples (see module docstring).

    ``lr_warmup_steps`` may be fractional: Megatron's ``--lr-warmup-fraction`` gives
    ``fraction * lr_decay_steps`` without rounding. ``start_weight_decay`` and
    ``end_weight_decay`` default to ``weight_decay`` (Megatron requires both only for
    a non-constant increment style). ``wd_incr_steps`` defaults to ``lr_decay_steps``;
    Megatron uses the whole training length (``train_iters * global_batch_size``).
    """

    lr: float
    lr_decay_steps: int
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_warmup_steps: float = 0
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_steps: int | None = None
    weight_decay: float = 0.01
    start_weight_decay: float | None = None
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"
    wd_incr_steps: int | None = None
    # --decoupled-lr / --decoupled-min-lr: the bounds of the groups marked ``is_decoupled_lr``
    # (the input embedding and output layer); None: no such groups / --min-lr.
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    # For messages only: the flags each value came from (field name -> text) and the samples
    # of one iteration (--global-batch-size under --train-iters) to show lengths in iterations.
    flags: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    iteration_samples: int | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.start_weight_decay is None:
            self.start_weight_decay = self.weight_decay
        if self.end_weight_decay is None:
            self.end_weight_decay = self.weight_decay
        if self.wd_incr_steps is None:
            self.wd_incr_steps = self.lr_decay_steps
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the flag when the schedule cannot be built."""
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {LR_DECAY_STYLES}, got {self.lr_decay_style!r}")
        if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(
                f"--lr-wsd-decay-style must be one of {WSD_DECAY_STYLES}, got {self.lr_wsd_decay_style!r}"
            )
        if self.weight_decay_incr_style not in WD_INCR_STYLES:
            raise ValueError(
                f"--weight-decay-incr-style must be one of {WD_INCR_STYLES}, got {self.weight_decay_incr_style!r}"
            )
        if self.min_lr < 0.0:
            raise ValueError(f"--min-lr must be >= 0, got {self.min_lr}")
        if self.lr < self.min_lr:
            raise ValueError(f"--lr ({self.lr}) must be >= --min-lr ({self.min_lr})")
        if self.lr_warmup_init > self.lr:
            raise ValueError(f"--lr-warmup-init ({self.lr_warmup_init}) must be <= --lr ({self.lr})")
        if self.lr_decay_steps <= 0:
            raise ValueError(f"the learning-rate decay length (--lr-decay-iters/--lr-decay-samples) must be "
                             f"positive, got {self.lr_decay_steps} samples")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"the warmup length must be >= 0, got {self.lr_warmup_steps} samples")
        if self.lr_warmup_steps >= self.lr_decay_steps:
            raise ValueError(
                f"the warmup ({self.lr_warmup_steps} samples, --lr-warmup-iters/--lr-warmup-samples/"
                f"--lr-warmup-fraction) must be shorter than the decay ({self.lr_decay_steps} samples, "
                f"--lr-decay-iters/--lr-decay-samples)"
            )
        if self.lr_decay_style == "WSD":
            if self.lr_wsd_decay_steps is None:
                raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
            if not 0 < self.lr_wsd_decay_steps <= self.lr_decay_steps:
                raise ValueError(
                    f"--lr-wsd-decay-iters/--lr-wsd-decay-samples ({self.lr_wsd_decay_steps} samples) must be "
                    f"in (0, lr decay length = {self.lr_decay_steps} samples]"
                )
        assert self.start_weight_decay is not None and self.end_weight_decay is not None
        if self.start_weight_decay < 0.0:
            raise ValueError(f"--start-weight-decay must be >= 0, got {self.start_weight_decay}")
        if self.end_weight_decay < self.start_weight_decay:
            raise ValueError(
                f"--end-weight-decay ({self.end_weight_decay}) must be >= --start-weight-decay "
                f"({self.start_weight_decay})"
            )
        if self.weight_decay_incr_style == "constant" and self.start_weight_decay != self.end_weight_decay:
            raise ValueError("--weight-decay-incr-style constant needs --start-weight-decay == --end-weight-decay")
        if self.weight_decay_incr_style != "constant" and not self.wd_incr_steps:
            raise ValueError("a non-constant --weight-decay-incr-style needs a positive increment length")


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def lr_schedule_config_from_args(args: Any) -> LRScheduleConfig:
    """Build the schedule from Megatron-style parsed arguments (an ``argparse.Namespace``).

    Iteration-based (``--train-iters``): decay length ``--lr-decay-iters`` (default
    ``--train-iters``), warmup ``--lr-warmup-iters`` or ``--lr-warmup-fraction`` times the
    decay length, WSD anneal ``--lr-wsd-decay-iters``; all multiplied by
    ``--global-batch-size``. Sample-based (``--train-samples``): the ``*-samples`` flags,
    decay length defaulting to ``--train-samples``. The weight-decay increment spans the
    whole run. ``--start/--end-weight-decay`` default to ``--weight-decay`` and are
    required together for a non-constant ``--weight-decay-incr-style``.
    """
    train_iters = _arg(args, "train_iters")
    train_samples = _arg(args, "train_samples")
    gbs = _arg(args, "global_batch_size")
    warmup_fraction = _arg(args, "lr_warmup_fraction")
    flags: dict[str, str] = {}
    if train_iters:
        if train_samples:
            raise ValueError("give only one of --train-iters and --train-samples")
        if _arg(args, "lr_decay_samples") is not None or _arg(args, "lr_warmup_samples", 0):
            raise ValueError("--lr-decay-samples/--lr-warmup-samples need --train-samples; "
                             "with --train-iters use --lr-decay-iters/--lr-warmup-iters")
        if not gbs:
            raise ValueError("--global-batch-size must be set to convert iterations to samples")
        decay_iters = _arg(args, "lr_decay_iters")
        if decay_iters is None:
            decay_iters = train_iters
            flags["lr_decay_steps"] = "--train-iters x --global-batch-size; --lr-decay-iters defaults to --train-iters"
        else:
            flags["lr_decay_steps"] = "--lr-decay-iters x --global-batch-size"
        lr_decay_steps = decay_iters * gbs
        wd_incr_steps = train_iters * gbs
        flags["wd_incr_steps"] = "--train-iters x --global-batch-size: the increment spans the run"
        wsd_iters = _arg(args, "lr_wsd_decay_iters")
        wsd_steps = wsd_iters * gbs if wsd_iters is not None else None
        flags["lr_wsd_decay_steps"] = "--lr-wsd-decay-iters x --global-batch-size"
        warmup_iters = _arg(args, "lr_warmup_iters", 0) or 0
        if warmup_fraction is not None:
            if warmup_iters:
                raise ValueError("give only one of --lr-warmup-fraction and --lr-warmup-iters")
            lr_warmup_steps: float = warmup_fraction * lr_decay_steps
            flags["lr_warmup_steps"] = "--lr-warmup-fraction x the decay length"
        else:
            lr_warmup_steps = warmup_iters * gbs
            flags["lr_warmup_steps"] = "--lr-warmup-iters x --global-batch-size"
    elif train_samples:
        if _arg(args, "lr_decay_iters") is not None or _arg(args, "lr_warmup_iters", 0):
            raise ValueError("--lr-decay-iters/--lr-warmup-iters need --train-iters; "
                             "with --train-samples use --lr-decay-samples/--lr-warmup-samples")
        decay_samples = _arg(args, "lr_decay_samples")
        lr_decay_steps = decay_samples if decay_samples is not None else train_samples
        flags["lr_decay_steps"] = ("--lr-decay-samples" if decay_samples is not None else
                                   "--train-samples; --lr-decay-samples defaults to --train-samples")
        wd_incr_steps = train_samples
        flags["wd_incr_steps"] = "--train-samples: the increment spans the run"
        wsd_steps = _arg(args, "lr_wsd_decay_samples")
        flags["lr_wsd_decay_steps"] = "--lr-wsd-decay-samples"
        warmup_samples = _arg(args, "lr_warmup_samples", 0) or 0
        if warmup_fraction is not None:
            if warmup_samples:
                raise ValueError("give only one of --lr-warmup-fraction and --lr-warmup-samples")
            lr_warmup_steps = warmup_fraction * lr_decay_steps
            flags["lr_warmup_steps"] = "--lr-warmup-fraction x the decay length"
        else:
            lr_warmup_steps = warmup_samples
            flags["lr_warmup_steps"] = "--lr-warmup-samples"
    else:
        raise ValueError("give one of --train-iters and --train-samples")

    lr = _arg(args, "lr")
    if lr is None:
        raise ValueError("--lr is required")
    weight_decay = _arg(args, "weight_decay", 0.01)
    incr_style = _arg(args, "weight_decay_incr_style", "constant")
    start_wd = _arg(args, "start_weight_decay")
    end_wd = _arg(args, "end_weight_decay")
    if incr_style == "constant":
        if start_wd is not None or end_wd is not None:
            raise ValueError("--start-weight-decay/--end-weight-decay need a non-constant "
                             "--weight-decay-incr-style; use --weight-decay for a constant one")
        start_wd = end_wd = weight_decay
    elif start_wd is None or end_wd is None:
        raise ValueError(f"--weight-decay-incr-style {incr_style} needs both --start-weight-decay "
                         "and --end-weight-decay")
    return LRScheduleConfig(
        lr=lr,
        min_lr=_arg(args, "min_lr", 0.0),
        lr_decay_style=_arg(args, "lr_decay_style", "linear"),
        lr_decay_steps=lr_decay_steps,
        lr_warmup_steps=lr_warmup_steps,
        lr_warmup_init=_arg(args, "lr_warmup_init", 0.0),
        lr_wsd_decay_style=_arg(args, "lr_wsd_decay_style", "exponential"),
        lr_wsd_decay_steps=wsd_steps,
        weight_decay=weight_decay,
        start_weight_decay=start_wd,
        end_weight_decay=end_wd,
        weight_decay_incr_style=incr_style,
        wd_incr_steps=wd_incr_steps,
        decoupled_lr=_arg(args, "decoupled_lr"),
        decoupled_min_lr=_arg(args, "decoupled_min_lr"),
        flags=flags,
        iteration_samples=gbs if train_iters else None,
    )


class LRScheduler:
    """Sets ``lr`` and ``weight_decay`` of every optimizer parameter group from the step count.

    ``optimizer`` may be ``None`` (only ``get_lr``/``get_wd`` are then useful). The
    constructor applies step 0, as Megatron's scheduler does.
    """

    def __init__(self, optimizer: Any, cfg: LRScheduleConfig, num_steps: int = 0) -> None:
        cfg.validate()
        self.optimizer = optimizer
        self.cfg = cfg
        self.num_steps = num_steps
        self.step(0)

    # -- formulas -------------------------------------------------------------------------------
    def get_lr(self, step: int | None = None, param_group: Mapping[str, Any] | None = None) -> float:
        """Learning rate at ``step`` (default: the current step) for ``param_group``'s overrides.

        The group's ``lr_mult`` is not applied here (see :meth:`group_lr`).
        """
        c = self.cfg
        n = self.num_steps if step is None else step
        group = param_group or {}
        max_lr = float(group.get("max_lr", c.lr))
        min_lr = float(group.get("min_lr", c.min_lr))
        warmup = c.lr_warmup_steps
        if warmup > 0 and n <= warmup:
            return c.lr_warmup_init + (max_lr - c.lr_warmup_init) * float(n) / float(warmup)
        if c.lr_decay_style == "constant":
            return max_lr
        if n > c.lr_decay_steps:
            return min_lr
        if c.lr_decay_style == "inverse-square-root":
            lr = max_lr * max(warmup, 1) ** 0.5 / max(n, 1) ** 0.5
            return max(min_lr, lr)
        decay_ratio = float(n - warmup) / float(c.lr_decay_steps - warmup)
        assert 0.0 <= decay_ratio <= 1.0, decay_ratio
        if c.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif c.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:  # WSD
            assert c.lr_wsd_decay_steps is not None
            anneal_start = c.lr_decay_steps - c.lr_wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                q = float(n - anneal_start) / float(c.lr_wsd_decay_steps)
                if c.lr_wsd_decay_style == "linear":
                    coeff = 1.0 - q
                elif c.lr_wsd_decay_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * q) + 1.0)
                elif c.lr_wsd_decay_style == "exponential":
                    coeff = 2.0 * math.pow(0.5, q) - 1.0
                else:  # minus_sqrt
                    coeff = 1.0 - math.sqrt(q)
        return min_lr + coeff * (max_lr - min_lr)

    def get_wd(self, step: int | None = None, param_group: Mapping[str, Any] | None = None) -> float:
        """Weight decay at ``step`` before the group's ``wd_mult`` is applied."""
        c = self.cfg
        n = self.num_steps if step is None else step
        group = param_group or {}
        start_wd = float(group.get("start_wd", c.start_weight_decay))
        end_wd = float(group.get("end_wd", c.end_weight_decay))
        assert c.wd_incr_steps is not None
        if n > c.wd_incr_steps or c.weight_decay_incr_style == "constant":
            return end_wd
        ratio = float(n) / float(c.wd_incr_steps)
        if c.weight_decay_incr_style == "linear":
            coeff = ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return start_wd + coeff * (end_wd - start_wd)

    def group_lr(self, param_group: Mapping[str, Any], step: int | None = None) -> float:
        """The lr written into ``param_group``: the schedule times its ``lr_mult``."""
        return self.get_lr(step, param_group) * float(param_group.get("lr_mult", 1.0))

    def group_wd(self, param_group: Mapping[str, Any], step: int | None = None) -> float:
        """The weight decay written into ``param_group``: the schedule times its ``wd_mult``."""
        return self.get_wd(step, param_group) * float(param_group.get("wd_mult", 1.0))

    # -- stepping -------------------------------------------------------------------------------
    @property
    def param_groups(self) -> Iterable[dict]:
        return [] if self.optimizer is None else self.optimizer.param_groups

    def step(self, increment: int) -> None:
        """Advance by ``increment`` samples and write lr / weight decay into every group
        (also empty ones, which keep the logged lr valid on ranks without parameters)."""
        self.num_steps += increment
        for group in self.param_groups:
            group["lr"] = self.group_lr(group)
            group["weight_decay"] = self.group_wd(group)

    def current_lr(self) -> float:
        """The lr Megatron logs: the first group that keeps the default schedule, else the base."""
        for group in self.param_groups:
            if group.get("default_config", True):
                return float(group["lr"])
        return self.get_lr()

    # -- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain data, with Megatron's key names (and megatrain's for the values Megatron lacks)."""
        out: dict[str, Any] = {key: getattr(self.cfg, name) for key, name, _, _ in _SCHEDULE_VALUES}
        out["num_steps"] = self.num_steps
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], *, use_checkpoint: bool = False,
                        override: bool = False) -> list[str]:
        """Restore the step count and settle every schedule value with the checkpoint's, as
        Megatron-LM's ``OptimizerParamScheduler.load_state_dict`` does; returns notes to print.

        Neither flag: a value that differs raises :class:`ScheduleMismatch` listing every
        difference, one line each. ``use_checkpoint`` (``--use-checkpoint-opt_param-scheduler``):
        the checkpoint's values replace the flags'. ``override`` (``--override-opt_param-scheduler``):
        the flags' values are kept. In every case the step count is the checkpoint's, so warmup
        and decay continue where the saved run stopped. Values the checkpoint does not hold keep
        the flags'. Call :meth:`apply_group_bounds` after the optimizer state is loaded.
        """
        if use_checkpoint and override:
            raise ValueError("give only one of --override-opt_param-scheduler and "
                             "--use-checkpoint-opt_param-scheduler")
        c = self.cfg
        # megatrain's extra values count only where they act (Megatron's nine always count).
        inert = set()
        if "WSD" not in (c.lr_decay_style, state_dict.get("lr_decay_style")):
            inert |= {"lr_wsd_decay_steps", "lr_wsd_decay_style"}
        if c.decoupled_lr is None and state_dict.get("decoupled_lr") is None:
            inert.add("decoupled_min_lr")
        differences = []
        for key, name, what, default_flags in _SCHEDULE_VALUES:
            if key not in state_dict or name in inert or _same(state_dict[key], getattr(c, name)):
                continue
            saved, ours = state_dict[key], getattr(c, name)
            differences.append(f"{what} ({c.flags.get(name, default_flags)}): checkpoint "
                               f"{self._show(name, saved)}, flags {self._show(name, ours)}")
            if use_checkpoint:
                setattr(c, name, saved)
        notes = []
        if differences and not (use_checkpoint or override):
            raise ScheduleMismatch(
                "the learning-rate schedule of the flags differs from the checkpoint's:\n  "
                + "\n  ".join(differences)
                + "\n(--override-opt_param-scheduler trains with the flags' values, "
                  "--use-checkpoint-opt_param-scheduler with the checkpoint's; the step count is restored either way)")
        if differences:
            side = "the checkpoint's" if use_checkpoint else "the flags'"
            flag = "--use-checkpoint-opt_param-scheduler" if use_checkpoint else "--override-opt_param-scheduler"
            notes.append(f" note: {flag}: training with {side} learning-rate schedule where they differ:\n   "
                         + "\n   ".join(differences))
        if use_checkpoint:
            try:
                c.validate()
            except ValueError as e:
                raise ScheduleMismatch(f"the checkpoint's learning-rate schedule is not valid: {e}") from None
        self.num_steps = 0
        self.step(int(state_dict["num_steps"]))
        return notes

    def apply_group_bounds(self) -> None:
        """Write the schedule's peak and minimum lr into the groups' ``max_lr``/``min_lr`` and
        recompute their lr: the default groups take ``lr``/``min_lr``, the ``is_decoupled_lr``
        groups ``decoupled_lr``/``decoupled_min_lr`` (default ``min_lr``).

        Loading an optimizer state restores the saved groups' bounds; this makes the settled
        schedule (:meth:`load_state_dict`) the one that runs. Groups with bounds of their own
        (neither kind) keep them.
        """
        c = self.cfg
        for group in self.param_groups:
            if group.get("is_decoupled_lr", False):
                if c.decoupled_lr is not None:
                    group["max_lr"] = c.decoupled_lr
                    group["min_lr"] = c.min_lr if c.decoupled_min_lr is None else c.decoupled_min_lr
            elif group.get("default_config", True):
                group["max_lr"], group["min_lr"] = c.lr, c.min_lr
        self.step(0)

    def _show(self, name: str, value: Any) -> str:
        """A value for a message; sample counts also in iterations when training by iterations."""
        n = self.cfg.iteration_samples
        if name.endswith("_steps") and isinstance(value, (int, float)):
            text = f"{int(value) if float(value).is_integer() else value} samples"
            if n and float(value) % n == 0:
                text += f" ({int(value) // n} iterations)"
            return text
        return "none" if value is None else str(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


# (state-dict key, LRScheduleConfig field, what it is, its flags when the config does not say).
# The first nine are Megatron-LM's OptimizerParamScheduler state; megatrain adds the rest.
_SCHEDULE_VALUES = (
    ("max_lr", "lr", "learning rate", "--lr"),
    ("min_lr", "min_lr", "minimum learning rate", "--min-lr"),
    ("lr_warmup_steps", "lr_warmup_steps", "warmup", "--lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction"),
    ("lr_decay_steps", "lr_decay_steps", "decay length", "--lr-decay-iters/--lr-decay-samples"),
    ("lr_decay_style", "lr_decay_style", "decay style", "--lr-decay-style"),
    ("start_wd", "start_weight_decay", "start weight decay", "--start-weight-decay/--weight-decay"),
    ("end_wd", "end_weight_decay", "end weight decay", "--end-weight-decay/--weight-decay"),
    ("wd_incr_steps", "wd_incr_steps", "weight-decay increment length", "--train-iters/--train-samples"),
    ("wd_incr_style", "weight_decay_incr_style", "weight-decay increment style", "--weight-decay-incr-style"),
    ("lr_warmup_init", "lr_warmup_init", "warmup initial learning rate", "--lr-warmup-init"),
    ("lr_wsd_decay_steps", "lr_wsd_decay_steps", "WSD anneal length", "--lr-wsd-decay-iters/--lr-wsd-decay-samples"),
    ("lr_wsd_decay_style", "lr_wsd_decay_style", "WSD anneal style", "--lr-wsd-decay-style"),
    ("decoupled_lr", "decoupled_lr", "decoupled learning rate", "--decoupled-lr"),
    ("decoupled_min_lr", "decoupled_min_lr", "decoupled minimum learning rate", "--decoupled-min-lr"),
)
