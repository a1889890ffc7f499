"""Megatron's log lines (exact bytes), their parsers and the TensorBoard writer."""

from __future__ import annotations

import importlib.util
import math
from datetime import datetime

import pytest

from megatrain.training.logging import (
    MetricsWriter,
    format_train_log_line,
    format_validation_block,
    format_validation_line,
    parse_train_log_line,
    parse_validation_line,
)

TS = datetime(2024, 5, 1, 12, 34, 56)

MEGATRON_PART = (
    " [2024-05-01 12:34:56]"
    " iteration      100/    1000 |"
    " consumed samples:         3200 |"
    " elapsed time per iteration (ms): 1234.6 |"
    " throughput per GPU (TFLOP/s/GPU): 123.5 |"
    " learning rate: 3.000000E-04 |"
    " global batch size:    32 |"
    " lm loss: 2.345679E+00 |"
    " loss scale: 1.0 |"
    " grad norm: 0.988 |"
    " number of skipped iterations:   0 |"
    " number of nan iterations:   1 |"
)


def _line(**over):
    kw = dict(iteration=100, train_iters=1000, consumed_samples=3200, elapsed_ms=1234.56, throughput_tflops=123.456,
              learning_rate=3.0e-4, global_batch_size=32, losses={"lm loss": 2.345678912}, loss_scale=1.0,
              grad_norm=0.98765, skipped_iterations=0, nan_iterations=1, timestamp=TS)
    kw.update(over)
    return format_train_log_line(**kw)


def test_megatron_fields_exactly():
    assert _line() == MEGATRON_PART


def test_extra_fields_follow_megatron_part():
    line = _line(tokens_per_sec_per_gpu=51234.56, mfu=0.4123, peak_mem_gib=12.3456)
    assert line == MEGATRON_PART + " tokens/s/GPU: 51234.6 | MFU: 41.23% | peak mem (GiB): 12.35 |"
    assert line.startswith(MEGATRON_PART)


def test_optional_fields_are_left_out_like_megatron():
    line = _line(grad_norm=None, learning_rate=None, throughput_tflops=None, losses={"lm loss": float("nan")},
                 loss_scale=65536.0, skipped_iterations=3, nan_iterations=0)
    assert line == (
        " [2024-05-01 12:34:56] iteration      100/    1000 | consumed samples:         3200 |"
        " elapsed time per iteration (ms): 1234.6 | global batch size:    32 | loss scale: 65536.0 |"
        " number of skipped iterations:   3 | number of nan iterations:   0 |"
    )
    line = _line(skipped_samples=64, num_zeros=7, params_norm=123.4567)
    assert " consumed samples:         3200 | skipped samples:           64 | elapsed" in line
    assert " grad norm: 0.988 | num zeros: 7 | params norm: 123.457 | number of skipped" in line


def test_parse_round_trip():
    line = _line(tokens_per_sec_per_gpu=51234.56, mfu=0.4123, peak_mem_gib=12.3456)
    d = parse_train_log_line(line)
    assert d["timestamp"] == "2024-05-01 12:34:56"
    assert (d["iteration"], d["train_iters"], d["consumed samples"]) == (100, 1000, 3200)
    assert d["elapsed time per iteration (ms)"] == 1234.6
    assert d["throughput per GPU (TFLOP/s/GPU)"] == 123.5
    assert d["learning rate"] == 3.0e-4
    assert d["global batch size"] == 32
    assert d["lm loss"] == pytest.approx(2.345679)
    assert d["loss scale"] == 1.0 and d["grad norm"] == 0.988
    assert d["number of skipped iterations"] == 0 and d["number of nan iterations"] == 1
    assert d["tokens/s/GPU"] == 51234.6 and d["MFU"] == 41.23 and d["peak mem (GiB)"] == 12.35
    # Re-formatting the parsed values gives the same line.
    again = format_train_log_line(
        iteration=d["iteration"], train_iters=d["train_iters"], consumed_samples=d["consumed samples"],
        elapsed_ms=d["elapsed time per iteration (ms)"], throughput_tflops=d["throughput per GPU (TFLOP/s/GPU)"],
        learning_rate=d["learning rate"], global_batch_size=d["global batch size"], losses={"lm loss": d["lm loss"]},
        loss_scale=d["loss scale"], grad_norm=d["grad norm"], skipped_iterations=d["number of skipped iterations"],
        nan_iterations=d["number of nan iterations"], tokens_per_sec_per_gpu=d["tokens/s/GPU"], mfu=d["MFU"] / 100,
        peak_mem_gib=d["peak mem (GiB)"], timestamp=datetime.strptime(d["timestamp"], "%Y-%m-%d %H:%M:%S"))
    assert again == line


def test_parse_accepts_megatron_microsecond_timestamps():
    line = (" [2025-01-02 03:04:05.123456] iteration        5/      10 | consumed samples:           40 |"
            " elapsed time per iteration (ms): 88.0 | learning rate: 1.000000E-05 | global batch size:     8 |"
            " lm loss: 1.050000E+01 | loss scale: 1.0 | number of skipped iterations:   0 |"
            " number of nan iterations:   0 |\n")
    d = parse_train_log_line(line)
    assert d["iteration"] == 5 and d["lm loss"] == 10.5 and "grad norm" not in d
    with pytest.raises(ValueError):
        parse_train_log_line(" validation loss at iteration 5 | lm loss value: 1.0E+00 |")


def test_validation_line_and_block():
    line = format_validation_line(200, 2.0)
    assert line == " validation loss at iteration 200 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 | "
    high = format_validation_line(10, 25.0)
    assert high.endswith("| lm loss PPL: 4.851652E+08 | ")          # exp(min(20, 25)) = exp(20)
    end = format_validation_line(10, {"lm loss": 1.0}, prefix="iteration 10 on test set")
    assert end.startswith(" validation loss at iteration 10 on test set | lm loss value: 1.000000E+00 |")
    block = format_validation_block(line).split("\n")
    assert block[1] == line and block[0] == block[2] == "-" * (len(line) + 1)
    d = parse_validation_line(line)
    assert d["iteration"] == 200 and d["lm loss value"] == 2.0 and d["lm loss PPL"] == pytest.approx(math.exp(2))


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path / "tb") as w:
        for it in (1, 2, 3):
            w.log_train(it, consumed_samples=8 * it, losses={"lm loss": 10.0 - it}, learning_rate=1e-4 * it,
                        batch_size=8, loss_scale=1.0, grad_norm=0.5 * it, throughput_tflops=100.0 + it,
                        memory={"mem-max-allocated-bytes": 1024.0 * it})
        w.log_validation(3, 2.5, consumed_samples=24, log_ppl=True)
        w.log_config({"lr": 1e-4, "seq_length": 16})
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "loss-scale", "throughput", "batch-size",
            "mem-max-allocated-bytes", "lm loss validation", "lm loss validation ppl",
            "lm loss vs samples", "lm loss validation vs samples"} <= tags

    def series(tag):
        return [(e.step, e.value) for e in ea.Scalars(tag)]

    assert series("lm loss") == [(1, 9.0), (2, 8.0), (3, 7.0)]
    assert series("lm loss vs samples") == [(8, 9.0), (16, 8.0), (24, 7.0)]
    assert [s for s, _ in series("learning-rate")] == [1, 2, 3]
    assert series("learning-rate")[2][1] == pytest.approx(3e-4)
    assert series("grad-norm") == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert series("mem-max-allocated-bytes")[-1] == (3, 3072.0)
    assert series("lm loss validation") == [(3, 2.5)]
    assert series("lm loss validation ppl")[0][1] == pytest.approx(math.exp(2.5), rel=1e-6)


def test_disabled_writer_writes_nothing(tmp_path):
    w = MetricsWriter(tmp_path / "tb", enabled=False)
    w.log_train(1, consumed_samples=8, losses={"lm loss": 1.0})
    w.close()
    assert not (tmp_path / "tb").exists()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb installed: would start a run")
def test_wandb_missing_warns(tmp_path):
    with pytest.warns(UserWarning, match="wandb"):
        w = MetricsWriter(tmp_path / "tb", wandb_project="proj")
    assert w.wandb is None and w.tb is not None
    w.close()
