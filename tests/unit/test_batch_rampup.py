"""--rampup-batch-size: the batch schedule, the iteration count and the flag checks, as in Megatron-LM."""

from __future__ import annotations

import pytest

from megatrain.training.arguments import parse_args, validate_args
from megatrain.training.batch_rampup import BatchRampup


def megatron_batch(consumed: int, start: int, inc: int, samples: int, gbs: int) -> int:
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator.update, transcribed as a plain formula."""
    if consumed > samples:
        return gbs
    per_increment = samples / ((gbs - start) / inc)
    return start + int(consumed / per_increment) * inc


@pytest.mark.parametrize("start, inc, samples, gbs", [(4, 4, 48, 16), (16, 16, 5000, 256), (8, 8, 0, 64),
                                                      (32, 32, 1000, 32)])
def test_schedule_follows_megatron(start, inc, samples, gbs):
    r = BatchRampup(start, inc, samples, gbs, micro_batch_times_dp=start if start % 8 else 8)
    consumed, seen = 0, []
    while consumed < 2 * samples + 10 * gbs:
        b = r.global_batch_size_at(consumed)
        expected = gbs if gbs == start or samples == 0 else megatron_batch(consumed, start, inc, samples, gbs)
        assert b == expected, consumed
        seen.append(b)
        consumed += b
    assert seen == sorted(seen) and seen[-1] == gbs


def test_iteration_count():
    r = BatchRampup(4, 4, 48, 16, micro_batch_times_dp=4)
    # 4,4,4,4 (16 samples), 8,8 (32), 12,12 (56): ramp ends after 56 > 48; then (120 - 56) // 16 = 4
    assert r.iterations_for(120) == 8 + 4
    assert [r.micro_batches_at(c) for c in (0, 16, 32, 56)] == [1, 2, 3, 4]


@pytest.mark.parametrize("args, message", [
    ((4, 5, 48, 16, 4), "multiple of the increment"),
    ((6, 2, 48, 16, 4), "the start \\(6\\) must be a multiple of --micro-batch-size"),
    ((32, 4, 48, 16, 4), "exceeds --global-batch-size"),
    ((0, 4, 48, 16, 4), "must be positive"),
])
def test_bad_rampups_name_the_flag(args, message):
    with pytest.raises(ValueError, match=message):
        BatchRampup(*args)


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-3", "--mock-data", "--device", "cpu"]


def test_flags():
    a = parse_args([*BASE, "--train-samples", "120", "--rampup-batch-size", "4", "4", "48"], validate=True)
    assert a.rampup_batch_size == [4, 4, 48] and a.train_iters_derived == 12
    with pytest.raises(SystemExit, match="needs sample-based training"):
        parse_args([*BASE, "--train-iters", "10", "--rampup-batch-size", "4", "4", "48"], validate=True)
    with pytest.raises(SystemExit, match="whole multiples of 2 micro-batches"):
        validate_args(parse_args([*BASE, "--train-samples", "120", "--rampup-batch-size", "2", "2", "48",
                                  "--pipeline-model-parallel-size", "2"], validate=False), world_size=2)
    with pytest.raises(SystemExit, match="multiple of the increment"):
        parse_args([*BASE, "--train-samples", "120", "--rampup-batch-size", "4", "5", "48"], validate=True)
