"""--step-batch-size-schedule: Megatron-LM's step-wise global batch schedule (its GPT-3 175B example's flag):
the parsing of thresholds (tokens, K/M/B/T, divided by --seq-length), the batch after a consumed-sample count,
the iteration count of a --train-samples run, and each bad schedule as one line naming the flag."""

from __future__ import annotations

import pytest

from megatrain.training.arguments import parse_args, validate_args
from megatrain.training.batch_rampup import StepBatchSchedule

EXAMPLE = "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"  # examples/gpt3/train_gpt3_175b_distributed.sh


def megatron_batch(entries: list[tuple[int, int]], consumed: int) -> int:
    """Megatron-LM's StepBatchsizeNumMicroBatchesCalculator._get_batch_size_for_samples, transcribed."""
    batch = entries[0][1]
    for threshold, size in entries:
        if consumed >= threshold:
            batch = size
        else:
            break
    return batch


def test_megatrons_example_schedule_in_samples_of_its_sequence_length():
    s = StepBatchSchedule.parse(EXAMPLE, 2048, micro_batch_times_dp=16)
    assert s.entries == ((0, 16), (1171875, 320), (2343750, 624), (3515625, 928), (4687500, 1232),
                         (5859375, 1536))  # 2.4e9 tokens // 2048, ...
    assert s.global_batch_size == 1536
    for consumed in (0, 1, 1171874, 1171875, 2343749, 5859374, 5859375, 10**12):
        assert s.global_batch_size_at(consumed) == megatron_batch(list(s.entries), consumed), consumed
    assert s.micro_batches_at(1171875) == 20


def test_entries_sort_take_commas_suffixes_and_samples_without_a_sequence_length():
    s = StepBatchSchedule.parse(" 2k:8,  0:4\t1.5K:6 ", None, micro_batch_times_dp=2)
    assert s.entries == ((0, 4), (1500, 6), (2000, 8))


def megatron_iterations(s: StepBatchSchedule, train_samples: int) -> int:
    """Megatron-LM's update_train_iters with a step schedule, transcribed."""
    consumed = iterations = 0
    while consumed < train_samples:
        consumed += megatron_batch(list(s.entries), consumed)
        iterations += 1
    return iterations


@pytest.mark.parametrize("train_samples", [1, 3, 4, 10, 11, 12, 100, 1001, 10**5 + 7])
def test_iteration_count_of_a_sample_based_run(train_samples):
    s = StepBatchSchedule.parse("0:2 10:4 30:8", None, micro_batch_times_dp=2)
    assert s.iterations_for(train_samples) == megatron_iterations(s, train_samples)


@pytest.mark.parametrize("text, message", [
    ("16:32 0", '"0" is not THRESHOLD:BATCH_SIZE'),
    ("0:16 1X:32", "'1X' is not a count"),
    ("0:16 -5:32", "'-5' is not a count"),
    ("10:16 20:32", 'the first entry must start at threshold 0, got "10:16"'),
    ("0:16 1K:32 1000:48", 'thresholds must increase: "1K:32" and "1000:48" are both 1000 samples'),
    ("0:16 100:30", '"100:30": the batch size must be a positive multiple of --micro-batch-size x data-parallel '
                    "size \\(4\\)"),
    ("0:0", "positive multiple"),
    ("   ", "no THRESHOLD:BATCH_SIZE entries"),
])
def test_bad_schedules_name_the_flag_and_the_entry(text, message):
    with pytest.raises(ValueError, match=message) as e:
        StepBatchSchedule.parse(text, None, micro_batch_times_dp=4)
    assert str(e.value).startswith("--step-batch-size-schedule: ")


def test_two_thresholds_that_become_one_sample_count_are_refused_naming_the_sequence_length():
    with pytest.raises(ValueError, match=r"both 0 samples \(tokens // --seq-length 2048\)"):
        StepBatchSchedule.parse("0:16 1K:32", 2048, micro_batch_times_dp=16)


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data", "--device", "cpu"]


def test_flags_set_the_global_batch_and_the_iterations():
    a = parse_args([*BASE, "--train-iters", "10", "--step-batch-size-schedule", "0:4 64:8 256:16"], validate=True)
    assert a.global_batch_size == 16 and a.num_micro_batches == 8 and a.train_iters_derived == 10
    # Megatron-LM's example passes --global-batch-size too: equal to the last batch, it is accepted
    b = parse_args([*BASE, "--train-samples", "100", "--global-batch-size", "16", "--step-batch-size-schedule",
                    "0:4 64:8 256:16"], validate=True)
    # thresholds 0, 4, 16 samples (tokens // 16): batches 4, 8, 8, then 16 x 5 reach the 100 samples
    assert b.train_iters_derived == 8
    assert b.global_batch_size == 16


@pytest.mark.parametrize("extra, message", [
    (["--global-batch-size", "32"], r"--global-batch-size \(32\) must equal the last batch size of "
                                    r"--step-batch-size-schedule \(16\)"),
    (["--rampup-batch-size", "4", "4", "16"], "both set the batch size's growth: give one"),
    (["--step-batch-size-schedule", "0:4 64:5"], '"64:5": the batch size must be a positive multiple'),
])
def test_bad_combinations_are_one_line(extra, message):
    argv = [*BASE, "--train-samples", "100", "--step-batch-size-schedule", "0:4 256:16", *extra]
    with pytest.raises(SystemExit, match=message):
        parse_args(argv, validate=True)


def test_pipeline_stages_need_whole_pipeline_schedules_at_every_batch():
    with pytest.raises(SystemExit, match="whole multiple of 2 micro-batches"):
        validate_args(parse_args([*BASE, "--train-iters", "10", "--pipeline-model-parallel-size", "2",
                                  "--step-batch-size-schedule", "0:2 256:16"], validate=False), world_size=2)


def test_the_schedule_split_into_words_is_one_schedule():
    """Megatron-LM's example expands its array unquoted, so the shell hands the schedule over word by word."""
    a = parse_args([*BASE, "--train-iters", "10", "--step-batch-size-schedule", "0:4", "64:8", "256:16"],
                   validate=True)
    assert a.step_batch_size_schedule == "0:4 64:8 256:16" and a.global_batch_size == 16
