"""Megatron-LM's training and validation log lines, and TensorBoard / Weights & Biases metrics.

The training line is Megatron's, field for field, so that parsers written for
Megatron logs keep working; this project's own fields (tokens/s/GPU, MFU, peak
memory) come after Megatron's last field in the same `` key: value |`` style::

     [2024-05-01 12:00:00] iteration      100/    1000 | consumed samples:         3200 | ...
     ... | number of skipped iterations:   0 | number of nan iterations:   0 | tokens/s/GPU: 1234.5 | ...

Like Megatron: the learning rate is left out when unknown (None), a loss only
appears when its value is >= 0 (nan is left out), ``grad norm`` / ``num zeros`` /
``params norm`` only when given (an fp16 step skipped for overflow has no grad norm),
``throughput per GPU`` only when given (Megatron's ``--log-throughput``), and
``loss scale`` is always printed (1.0 without fp16 loss scaling).
"""

from __future__ import annotations

import math
import os
import re
import warnings
from datetime import datetime
from typing import Any, Mapping

TIMESTAMP_FORMAT = "%Y-%m-%d %H:%M:%S"

# Field names as they appear in the line (keys of parse_train_log_line's result).
TOKENS_PER_SEC_KEY = "tokens/s/GPU"
MFU_KEY = "MFU"
PEAK_MEM_KEY = "peak mem (GiB)"


def format_train_log_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    learning_rate: float | None,
    global_batch_size: int,
    losses: Mapping[str, float],
    loss_scale: float = 1.0,
    grad_norm: float | None = None,
    skipped_iterations: int = 0,
    nan_iterations: int = 0,
    throughput_tflops: float | None = None,
    skipped_samples: int = 0,
    num_zeros: int | None = None,
    params_norm: float | None = None,
    tokens_per_sec_per_gpu: float | None = None,
    mfu: float | None = None,
    peak_mem_gib: float | None = None,
    timestamp: datetime | None = None,
) -> str:
    """One training log line.

    ``elapsed_ms``: average milliseconds per iteration over the log interval;
    ``losses``: averages over the interval's advanced iterations, e.g. ``{"lm loss": 2.31}``;
    ``skipped_iterations`` / ``nan_iterations``: counts over the interval;
    ``mfu``: a fraction (0.41 prints as ``MFU: 41.00%``).
    """
    ts = (timestamp or datetime.now()).strftime(TIMESTAMP_FORMAT)
    s = f" [{ts}]"
    s += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    s += " consumed samples: {:12d} |".format(consumed_samples)
    if skipped_samples > 0:
        s += " skipped samples: {:12d} |".format(skipped_samples)
    s += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_ms)
    if throughput_tflops is not None:
        s += f" throughput per GPU (TFLOP/s/GPU): {throughput_tflops:.1f} |"
    if learning_rate is not None:
        s += f" learning rate: {learning_rate:.6E} |"
    s += f" global batch size: {global_batch_size:5d} |"
    for key, value in losses.items():
        if value >= 0.0:
            s += " {}: {:.6E} |".format(key, value)
    s += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        s += f" grad norm: {grad_norm:.3f} |"
    if num_zeros is not None:
        s += f" num zeros: {num_zeros} |"
    if params_norm is not None:
        s += f" params norm: {params_norm:.3f} |"
    s += " number of skipped iterations: {:3d} |".format(skipped_iterations)
    s += " number of nan iterations: {:3d} |".format(nan_iterations)
    # This project's fields, after all of Megatron's.
    if tokens_per_sec_per_gpu is not None:
        s += f" {TOKENS_PER_SEC_KEY}: {tokens_per_sec_per_gpu:.1f} |"
    if mfu is not None:
        s += f" {MFU_KEY}: {100.0 * mfu:.2f}% |"
    if peak_mem_gib is not None:
        s += f" {PEAK_MEM_KEY}: {peak_mem_gib:.2f} |"
    return s


_TRAIN_HEAD = re.compile(
    r"^\s*\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\]"
    r" iteration\s+(?P<it>\d+)/\s*(?P<total>\d+) \|(?P<rest>.*)$"
)
_INT = re.compile(r"^[+-]?\d+$")


def _parse_value(text: str) -> int | float | str:
    text = text.strip()
    if _INT.match(text):
        return int(text)
    number = text[:-1] if text.endswith("%") else text
    try:
        return float(number)
    except ValueError:
        return text


def _parse_fields(rest: str) -> dict[str, int | float | str]:
    out: dict[str, int | float | str] = {}
    for field in rest.split(" |"):
        field = field.strip()
        if not field:
            continue
        key, sep, value = field.partition(": ")
        if not sep:
            raise ValueError(f"malformed log field {field!r}")
        out[key] = _parse_value(value)
    return out


def parse_train_log_line(line: str) -> dict[str, Any]:
    """Parse a training line (Megatron's or ours) into a dict.

    Keys: ``timestamp`` (str), ``iteration``, ``train_iters`` and every field by its
    printed name (``"consumed samples"``, ``"lm loss"``, ``"grad norm"``, ``"MFU"`` in
    percent, ...); integer-looking values become int, other numbers float.
    Raises ValueError when ``line`` is not a training log line.
    """
    m = _TRAIN_HEAD.match(line.rstrip("\r\n"))
    if not m:
        raise ValueError(f"not a training log line: {line!r}")
    out: dict[str, Any] = {
        "timestamp": m.group("ts"),
        "iteration": int(m.group("it")),
        "train_iters": int(m.group("total")),
    }
    out.update(_parse_fields(m.group("rest")))
    return out


def format_validation_line(
    iteration: int,
    loss: float | Mapping[str, float],
    *,
    prefix: str | None = None,
    suffix: str = "",
) -> str:
    """Megatron's validation line, trailing space included:
    `` validation loss at iteration N | lm loss value: X | lm loss PPL: Y | ``.

    ``loss`` is the ``lm loss`` value or a mapping of loss names to values. ``prefix``
    replaces ``iteration N`` (Megatron prints ``iteration N on validation set`` /
    ``... on test set`` after training); ``suffix`` follows ``validation`` (``-0`` for
    the first of several validation sets). PPL is ``exp(min(20, loss))`` (NaN for a NaN loss).
    """
    losses = {"lm loss": loss} if not isinstance(loss, Mapping) else loss
    where = prefix if prefix is not None else f"iteration {iteration}"
    s = f" validation{suffix} loss at {where} | "
    for key, value in losses.items():
        s += "{} value: {:.6E} | ".format(key, value)
        s += "{} PPL: {:.6E} | ".format(key, validation_ppl(value))
    return s


def validation_ppl(loss: float) -> float:
    """Megatron's perplexity: exp of the loss capped at 20 (NaN for a NaN loss, which ``min`` would
    turn into the cap)."""
    return math.nan if math.isnan(loss) else math.exp(min(20, loss))


def format_validation_block(line: str) -> str:
    """The validation line between two rules of dashes one longer than it, as Megatron prints."""
    rule = "-" * (len(line) + 1)
    return f"{rule}\n{line}\n{rule}"


_VALID_HEAD = re.compile(r"^\s*validation(?P<suffix>\S*) loss at (?P<where>.*?) \|(?P<rest>.*)$")


def parse_validation_line(line: str) -> dict[str, Any]:
    """Parse a validation line into ``{"where": "iteration 100", "suffix": "", "lm loss value": ...,
    "lm loss PPL": ...}`` (plus ``"iteration"`` when ``where`` starts with one)."""
    m = _VALID_HEAD.match(line.rstrip("\r\n"))
    if not m:
        raise ValueError(f"not a validation log line: {line!r}")
    out: dict[str, Any] = {"where": m.group("where"), "suffix": m.group("suffix")}
    it = re.match(r"iteration (\d+)", m.group("where"))
    if it:
        out["iteration"] = int(it.group(1))
    out.update(_parse_fields(m.group("rest")))
    return out


def cuda_memory_scalars() -> dict[str, float]:
    """Megatron's ``--log-memory-to-tensorboard`` values for the current device ({} without CUDA)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    stats = torch.cuda.memory_stats()
    return {
        "mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
        "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
        "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
        "mem-allocated-count": stats.get("allocation.all.current", 0),
    }


class MetricsWriter:
    """TensorBoard (``--tensorboard-dir``) and optional wandb (``--wandb-project``) scalars.

    Create it on the rank that logs (Megatron: the last rank) with ``enabled=True``;
    other ranks may build it with ``enabled=False`` and call it freely. Tags are
    Megatron's; every per-iteration scalar is also written as ``"<tag> vs samples"``
    against consumed samples, as Megatron does.
    """

    def __init__(
        self,
        tensorboard_dir: str | os.PathLike | None = None,
        *,
        enabled: bool = True,
        queue_size: int = 1000,
        wandb_project: str | None = None,
        wandb_exp_name: str | None = None,
        wandb_save_dir: str | os.PathLike | None = None,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=os.fspath(tensorboard_dir), max_queue=queue_size)
        if wandb_project:
            try:
                import wandb  # type: ignore[import-not-found]
            except ImportError:
                warnings.warn(
                    f"--wandb-project {wandb_project} was given but the wandb package is not installed "
                    "(pip install wandb); metrics go to TensorBoard only.",
                    stacklevel=2,
                )
            else:
                save_dir = os.fspath(wandb_save_dir) if wandb_save_dir else None
                if save_dir:
                    os.makedirs(save_dir, exist_ok=True)
                self.wandb = wandb.init(project=wandb_project, name=wandb_exp_name, dir=save_dir,
                                        config=dict(run_config or {}))

    @property
    def active(self) -> bool:
        return self.tb is not None or self.wandb is not None

    # -- generic ---------------------------------------------------------------------------------
    def add_scalar(self, tag: str, value: float, step: int, *, samples: int | None = None,
                   to_wandb: bool = True) -> None:
        """Write ``tag`` at ``step``; with ``samples`` also ``"<tag> vs samples"`` at ``samples``."""
        if self.tb is not None:
            self.tb.add_scalar(tag, value, step)
            if samples is not None:
                self.tb.add_scalar(f"{tag} vs samples", value, samples)
        if self.wandb is not None and to_wandb:
            self.wandb.log({tag: value}, step=step)

    def log_config(self, config: Mapping[str, Any], step: int = 0) -> None:
        """Each run argument as TensorBoard text, as Megatron's write_args_to_tensorboard does."""
        if self.tb is not None:
            for key in sorted(config):
                self.tb.add_text(str(key), str(config[key]), global_step=step)

    # -- training and validation -----------------------------------------------------------------
    def log_train(
        self,
        iteration: int,
        *,
        consumed_samples: int,
        losses: Mapping[str, float] | None = None,
        learning_rate: float | None = None,
        batch_size: int | None = None,
        loss_scale: float | None = None,
        grad_norm: float | None = None,
        num_zeros: int | None = None,
        params_norm: float | None = None,
        throughput_tflops: float | None = None,
        iteration_time_s: float | None = None,
        tokens_per_sec_per_gpu: float | None = None,
        mfu: float | None = None,
        memory: Mapping[str, float] | None = None,
    ) -> None:
        """Per-iteration scalars with Megatron's tags; None values are not written.

        Pass ``loss_scale`` only when ``--log-loss-scale-to-tensorboard`` is on (Megatron's
        default), ``throughput_tflops`` / ``iteration_time_s`` with
        ``--log-timers-to-tensorboard``, ``memory`` (see :func:`cuda_memory_scalars`) with
        ``--log-memory-to-tensorboard``.
        """
        if not self.active:
            return
        s = consumed_samples
        if self.wandb is not None:
            self.wandb.log({"samples vs steps": consumed_samples}, step=iteration)
        if learning_rate is not None:
            self.add_scalar("learning-rate", learning_rate, iteration, samples=s)
        if batch_size is not None:
            self.add_scalar("batch-size", batch_size, iteration, samples=s)
        for key, value in (losses or {}).items():
            self.add_scalar(key, value, iteration, samples=s)
        if loss_scale is not None:
            self.add_scalar("loss-scale", loss_scale, iteration, samples=s)
        if grad_norm is not None:
            self.add_scalar("grad-norm", grad_norm, iteration, samples=s)
        if num_zeros is not None:
            self.add_scalar("num-zeros", num_zeros, iteration, samples=s)
        if params_norm is not None:
            self.add_scalar("params-norm", params_norm, iteration, samples=s)
        if iteration_time_s is not None:
            self.add_scalar("iteration-time", iteration_time_s, iteration)
        if throughput_tflops is not None:
            self.add_scalar("throughput", throughput_tflops, iteration)
        if tokens_per_sec_per_gpu is not None:
            self.add_scalar("tokens-per-sec-per-gpu", tokens_per_sec_per_gpu, iteration)
        if mfu is not None:
            self.add_scalar("mfu", mfu, iteration)
        for tag, value in (memory or {}).items():
            self.add_scalar(tag, value, iteration, to_wandb=False)

    def log_validation(
        self,
        iteration: int,
        losses: float | Mapping[str, float],
        *,
        consumed_samples: int,
        log_ppl: bool = False,
        suffix: str = "",
    ) -> None:
        """``"<key> validation<suffix>"`` (and ``... ppl`` with ``--log-validation-ppl-to-tensorboard``)."""
        if not self.active:
            return
        values = {"lm loss": losses} if not isinstance(losses, Mapping) else losses
        for key, value in values.items():
            tag = f"{key} validation{suffix}"
            if self.tb is not None:
                self.tb.add_scalar(tag, value, iteration)
                self.tb.add_scalar(f"{tag} vs samples", value, consumed_samples)
                if log_ppl:
                    ppl = validation_ppl(value)
                    self.tb.add_scalar(f"{tag} ppl", ppl, iteration)
                    self.tb.add_scalar(f"{tag} ppl vs samples", ppl, consumed_samples)
            if self.wandb is not None:
                self.wandb.log({tag: value}, step=iteration)

    # -- lifetime --------------------------------------------------------------------------------
    def flush(self) -> None:
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
