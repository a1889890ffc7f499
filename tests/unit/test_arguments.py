"""The Megatron-compatible command line: defaults, legacy flags, --config, and every user error."""

from __future__ import annotations

import pytest

from megatrain.training.arguments import UNSUPPORTED_FLAGS, build_parser, parse_args, validate_args
from megatrain.models.gpt.config import gpt_config_from_args as model_config_from_args
from megatrain.training.builders import padded_vocab_size

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data"]


def parse(*extra: str, world_size: int = 1):
    args = parse_args([*BASE, *extra], validate=False)
    return validate_args(args, world_size=world_size)


def fails(capsys, *extra: str, world_size: int = 1) -> str:
    with pytest.raises(SystemExit) as e:
        parse(*extra, world_size=world_size)
    msg = str(e.value.code) if not isinstance(e.value.code, int) else capsys.readouterr().err
    return msg


def test_defaults_follow_megatron():
    a = parse()
    assert a.split.replace(" ", "") == "969,30,1"
    assert a.seed == 1234 and a.init_method_std == 0.02
    assert a.global_batch_size == 2 and a.num_micro_batches == 1
    assert a.max_position_embeddings == 32
    assert a.lr_decay_style == "linear" and a.clip_grad == 1.0 and a.weight_decay == 0.01
    assert a.num_query_groups == 4 and a.add_bias_linear
    assert a.eval_interval == 1000 and a.eval_iters == 100 and a.log_interval == 100


def test_gradient_accumulation_and_data_parallel():
    a = parse("--global-batch-size", "16", world_size=4)
    assert a.data_parallel_size == 4 and a.num_micro_batches == 2
    a = parse("--global-batch-size", "16", "--tensor-model-parallel-size", "2", world_size=4)
    assert a.data_parallel_size == 2 and a.num_micro_batches == 4


def test_llama_style_flags_reach_model_config():
    a = parse("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
              "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
              "--disable-bias-linear", "--norm-epsilon", "1e-6", "--rotary-base", "500000")
    cfg = model_config_from_args(a, 512)
    assert cfg.num_query_groups == 2 and cfg.swiglu and not cfg.add_bias_linear
    assert cfg.untie_embeddings_and_output_weights and cfg.normalization == "RMSNorm"
    assert cfg.rotary_base == 500000 and cfg.norm_epsilon == 1e-6


def test_legacy_flags_are_accepted_with_a_note():
    a = parse("--checkpoint-activations", "--distributed-backend", "nccl", "--use-flash-attn",
              "--num-gpus-per-node", "8", "--world-size", "8", "--use-mcore-models", "--batch-size", "2")
    assert a.recompute_granularity == "full" and a.recompute_method == "uniform"
    assert any("--checkpoint-activations" in n for n in a.legacy_notes)
    assert any("--use-flash-attn" in n for n in a.legacy_notes)


def test_unknown_flag_is_rejected_with_a_suggestion(capsys):
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--num-layer", "3"], validate=False)
    err = capsys.readouterr().err
    assert "--num-layer" in err and "did you mean --num-layers" in err


def test_known_unsupported_flag_says_why(capsys):
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--retro-project-dir", "x"], validate=False)
    assert "RETRO is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("extra,expected", [
    (["--num-attention-heads", "5"], "--hidden-size (64) must be divisible by --num-attention-heads (5)"),
    (["--global-batch-size", "3"], "--global-batch-size (3) must be a multiple of --micro-batch-size"),
    (["--max-position-embeddings", "16"], "--seq-length (32) is larger than --max-position-embeddings (16)"),
    (["--fp16", "--bf16"], "--fp16 and --bf16 cannot be used together"),
    (["--train-samples", "100"], "exactly one of --train-iters and --train-samples"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups (3)"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], "--lr-warmup-fraction and --lr-warmup-iters"),
])
def test_bad_combinations_name_the_flags(capsys, extra, expected):
    assert expected in fails(capsys, *extra)


def test_missing_data_is_an_error(capsys):
    args = parse_args([a for a in BASE if a != "--mock-data"], validate=False)
    with pytest.raises(SystemExit) as e:
        validate_args(args, world_size=1)
    assert "--data-path" in str(e.value.code)


def test_neither_train_iters_nor_samples(capsys):
    args = parse_args([a for a in BASE if a not in ("--train-iters", "10")], validate=False)
    with pytest.raises(SystemExit) as e:
        validate_args(args, world_size=1)
    assert "--train-iters" in str(e.value.code)


def test_world_size_must_divide_by_model_parallel(capsys):
    msg = fails(capsys, "--tensor-model-parallel-size", "4", world_size=6)
    assert "world size (6)" in msg and "--tensor-model-parallel-size (4)" in msg


def test_config_yaml_supplies_fields_and_flags_override(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("num-layers: 6\nhidden_size: 128\nswiglu: true\ndisable-bias-linear: true\nlr: 0.5\n")
    a = parse("--config", str(cfg), "--lr", "0.25")
    assert a.num_layers == 2  # the command line wins over the file
    a = parse_args(["--config", str(cfg), "--num-attention-heads", "4", "--seq-length", "8", "--micro-batch-size",
                    "1", "--train-iters", "1", "--mock-data"], validate=True)
    assert a.num_layers == 6 and a.hidden_size == 128 and a.swiglu and not a.add_bias_linear and a.lr == 0.5


def test_config_yaml_unknown_key(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("num_layerz: 6\n")
    with pytest.raises(SystemExit) as e:
        parse("--config", str(cfg))
    assert "unknown key 'num_layerz'" in str(e.value.code) and "num-layers" in str(e.value.code)


def test_vocab_padding_matches_megatron():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 4) == 50688
    assert padded_vocab_size(4096, 128, 1) == 4096


def test_every_flag_has_help_or_is_legacy():
    parser = build_parser()
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    assert len(flags) == len(set(flags))
    assert "--tensor-model-parallel-size" in flags and "--data-path" in flags and "--tokenizer-type" in flags


def test_no_refused_flag_is_a_flag_of_the_parser():
    """A flag listed as refused but parsed would show in the flag table as both supported and refused."""
    options = {o for action in build_parser()._actions for o in action.option_strings}
    assert sorted(set(UNSUPPORTED_FLAGS) & options) == []


def test_flag_table_doc_is_current():
    from pathlib import Path

    from megatrain.training.flag_table import render

    doc = Path(__file__).resolve().parents[2] / "docs" / "megatron_flags.md"
    assert doc.read_text(encoding="utf-8") == render(), (
        "docs/megatron_flags.md is stale: run python -m megatrain.training.flag_table docs/megatron_flags.md")


# Megatron-LM's examples/llama/train_llama2.sh, every flag it can pass (shapes shrunk).
LLAMA2_EXAMPLE = ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1 "
                  "--ffn-hidden-size 128 --max-position-embeddings 32000 --untie-embeddings-and-output-weights "
                  "--position-embedding-type rope --no-position-embedding --swiglu --disable-bias-linear "
                  "--init-method-std 0.02 --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm "
                  "--micro-batch-size 1 --global-batch-size 8 --no-async-tensor-model-parallel-allreduce --bf16 "
                  "--no-masked-softmax-fusion --recompute-num-layers 2 --recompute-granularity full "
                  "--recompute-method block --no-rope-fusion --lr 1e-4 --min-lr 1e-5 --lr-decay-iters 320000 "
                  "--lr-decay-style cosine --weight-decay 1.0e-1 --clip-grad 1.0 --optimizer adam --adam-beta1 0.9 "
                  "--adam-beta2 0.95 --split 99990,8,2 --dataloader-type cyclic --save-interval 200000 "
                  "--log-interval 1 --eval-interval 320000 --num-workers 8 --log-throughput --no-save-optim "
                  "--no-save-rng --eval-iters 10 --ckpt-format torch --no-load-optim --no-load-rng "
                  "--group-query-attention --num-query-groups 2 --no-gradient-accumulation-fusion "
                  "--distributed-backend nccl --distributed-timeout-minutes 120 --overlap-grad-reduce "
                  "--use-torch-fsdp2 --profile --use-pytorch-profiler --use-flash-attn --sequence-parallel "
                  "--use-contiguous-parameters-in-local-ddp --use-mcore-models --transformer-impl=transformer_engine "
                  "--fp8-margin=0 --fp8-format=hybrid --fp8-interval=1 --fp8-amax-history-len=1024 "
                  "--fp8-amax-compute-algo=max --attention-softmax-in-fp32 --keep_fp8_weight_transpose_cache "
                  "--wandb-project=LLama --wandb-exp-name=LLama_7B --wandb-save-dir logs/wandb").split()


def test_megatron_llama2_example_flags_are_accepted():
    pytest.importorskip("torchao.float8")
    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                       "64", "--train-iters", "12", "--mock-data", "--device", "cpu", *LLAMA2_EXAMPLE])
    assert args.zero_stage == 3 and args.fp8_format == "hybrid" and args.position_embedding_type == "rope"
    notes = "\n".join(args.legacy_notes)
    for flag in ("--use-torch-fsdp2", "--no-rope-fusion", "--fp8-interval", "--ckpt-format"):
        assert f"note: {flag}" in notes, flag
    assert args.dataloader_type == "cyclic" and args.data_sharding


def test_megatron_flags_that_cannot_work_here_raise_with_the_flag():
    for extra, expected in ((["--no-position-embedding"], "--no-position-embedding without"),
                            (["--dataloader-type", "external"], "--dataloader-type external"),
                            (["--use-checkpoint-args"], "--use-checkpoint-args needs --load")):
        with pytest.raises(SystemExit, match=expected):
            parse_args([*BASE, *extra])


def test_fp32_residual_connection_reaches_the_model_config():
    default = parse_args([*BASE, "--bf16"], validate=True)
    assert model_config_from_args(default, 128).fp32_residual_connection is False  # Megatron's default
    on = parse_args([*BASE, "--bf16", "--fp32-residual-connection"], validate=True)
    assert model_config_from_args(on, 128).fp32_residual_connection is True


# ---- issue 23: Megatron-LM users' scripts run unchanged ---------------------------------------------

def test_split_with_literal_quotes_as_bash_arrays_pass_it():
    from megatrain.data.dataset_builder import parse_split

    a = parse("--split", "'99,1,0'")
    assert parse_split(a.split) == pytest.approx([0.99, 0.01, 0.0])


@pytest.mark.parametrize("flag", ["--dataset-impl", "--data-impl"])
def test_old_data_format_flags(capsys, flag):
    for value in ("mmap", "infer"):
        a = parse(flag, value)
        assert any(n.startswith(f"note: {flag} ") for n in a.legacy_notes)
    msg = fails(capsys, flag, "lazy")
    assert "--dataset-impl lazy" in msg and "mmap" in msg and "\n" not in msg


def test_activations_checkpoint_method_is_the_old_recompute_method(capsys):
    a = parse("--activations-checkpoint-method", "block", "--activations-checkpoint-num-layers", "2")
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == ("full", "block", 2)
    assert any(n.startswith("note: --activations-checkpoint-method") for n in a.legacy_notes)
    assert "give only one" in fails(capsys, "--activations-checkpoint-method", "block", "--recompute-method",
                                    "uniform")
    a = parse("--checkpoint-activations", "--activations-checkpoint-num-layers", "2")
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == ("full", "uniform", 2)


def test_old_warmup_is_a_fraction_of_the_decay_iterations(capsys):
    a = parse("--warmup", "0.01")
    assert a.lr_warmup_fraction == 0.01 and any(n.startswith("note: --warmup") for n in a.legacy_notes)
    from megatrain.training.run_config import RunConfig

    assert RunConfig.from_args(a) is not None
    assert "--lr-warmup-iters" in fails(capsys, "--warmup", "0.1", "--lr-warmup-iters", "5")
    assert "[0, 1]" in fails(capsys, "--warmup", "100")


def test_recompute_activations_is_selective_recompute(capsys):
    a = parse("--recompute-activations")
    assert a.recompute_granularity == "selective"
    assert "--recompute-activations" in fails(capsys, "--recompute-activations", "--recompute-granularity", "full")
    assert "--recompute-activations" in fails(capsys, "--recompute-activations", "--checkpoint-activations")


def test_logging_level_sets_the_root_logger(monkeypatch):
    import logging

    from megatrain.training.console import setup_logging

    root = logging.getLogger()
    before = root.level
    try:
        assert parse("--logging-level", "30").logging_level == 30
        assert parse("--logging-level", "debug").logging_level == logging.DEBUG
        assert setup_logging(40) == 40 and root.level == 40
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "10")
        assert setup_logging(None) == 10 and root.level == 10  # the environment, as in Megatron-LM
        assert setup_logging(20) == 20 and root.level == 20  # the flag wins
    finally:
        root.setLevel(before)


def test_no_check_for_nan_keeps_training_through_nan_iterations():
    from types import SimpleNamespace

    from megatrain.training.step import StepMixin as TrainStep

    assert parse().check_for_nan_in_loss_and_grad is True
    a = parse("--no-check-for-nan-in-loss-and-grad")
    assert a.check_for_nan_in_loss_and_grad is False
    step = SimpleNamespace(state=SimpleNamespace(nan_iterations=50), args=a)
    TrainStep._stop_on_nan_iterations(step)  # does not stop
    with pytest.raises(SystemExit, match="--max-nan-iterations"):
        TrainStep._stop_on_nan_iterations(SimpleNamespace(state=step.state, args=parse()))


@pytest.mark.parametrize("strategy, stage", [("optim", 1), ("optim_grads", 2), ("optim_grads_params", 3),
                                             (None, 3), ("no_shard", 0)])
def test_megatron_fsdp_maps_to_zero_stages(strategy, stage):
    extra = ["--data-parallel-sharding-strategy", strategy] if strategy else []
    a = parse("--use-megatron-fsdp", *extra, "--use-distributed-optimizer", "--init-model-with-meta-device",
              "--fsdp-double-buffer", "--use-nccl-ub", "--ckpt-format", "fsdp_dtensor",
              "--outer-dp-sharding-strategy", "no_shard", "--num-distributed-optimizer-instances", "1",
              "--megatron-fsdp-main-params-dtype", "fp32", "--suggested-communication-unit-size", "1000",
              world_size=2)
    assert a.zero_stage == stage
    notes = "\n".join(a.legacy_notes)
    for flag in ("--use-megatron-fsdp", "--init-model-with-meta-device", "--fsdp-double-buffer", "--use-nccl-ub"):
        assert f"note: {flag} " in notes, flag


def test_megatron_fsdp_refusals_name_the_flag(capsys):
    assert "--zero-stage 3" in fails(capsys, "--use-megatron-fsdp", "--zero-stage", "1", world_size=2)
    assert "--outer-dp-sharding-strategy optim" in fails(capsys, "--use-megatron-fsdp",
                                                         "--outer-dp-sharding-strategy", "optim")
    assert "--num-distributed-optimizer-instances 2" in fails(capsys, "--num-distributed-optimizer-instances", "2")
    assert "--megatron-fsdp-main-params-dtype bf16" in fails(capsys, "--megatron-fsdp-main-params-dtype", "bf16")
    assert parse("--megatron-fsdp-grad-comm-dtype", "bf16").grad_reduce_in_bf16
    assert parse("--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward").zero_stage == 2


def test_notes_are_printed_by_rank_0_only(monkeypatch, capsys):
    from megatrain.training.console import print_rank0

    monkeypatch.setenv("RANK", "1")  # a launcher's rank before torch.distributed starts
    print_rank0("note: x")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    print_rank0("note: x")
    assert capsys.readouterr().out == "note: x\n"


@pytest.mark.parametrize("extra,line", [
    (["--num-layers", "x"], "argument --num-layers: invalid int value: 'x'"),
    (["--tokenizer-type", "Foo"], "argument --tokenizer-type: invalid choice: 'Foo'"),
    (["--seq-length"], "argument --seq-length: expected one argument"),
])
def test_a_bad_value_is_one_line_without_the_usage(capsys, extra, line):
    message = fails(capsys, *extra).strip()
    assert "\n" not in message and "usage:" not in message and line in message, message


def test_use_checkpoint_args_without_a_checkpoint_yet_trains_with_the_flags(tmp_path, capsys):
    """Megatron's first run of a script with --use-checkpoint-args: --load is empty, the flags stand
    (with a note); --exit-on-missing-checkpoint makes it an error line."""
    a = parse("--use-checkpoint-args", "--load", str(tmp_path))
    assert a.num_layers == 2 and any("no checkpoint in --load" in n for n in a.legacy_notes)
    message = fails(capsys, "--use-checkpoint-args", "--load", str(tmp_path), "--exit-on-missing-checkpoint")
    assert "--exit-on-missing-checkpoint: no checkpoint found in --load" in message


def test_dist_ckpt_strictness_takes_megatrons_modes():
    assert parse().dist_ckpt_strictness == "assume_ok_unexpected"  # Megatron's default
    for mode in ("log_unexpected", "log_all", "raise_unexpected", "raise_all", "ignore_all"):
        a = parse("--dist-ckpt-strictness", mode)
        assert a.dist_ckpt_strictness == mode and a.legacy_notes == []
    a = parse("--dist-ckpt-strictness", "return_all")  # Megatron's Python callers' mode: logged here
    assert a.legacy_notes == ["note: --dist-ckpt-strictness return_all: Megatron's loader hands the mismatched keys "
                              "back to its Python caller; a megatrain run has none and logs them, as log_all does"]
    with pytest.raises(SystemExit):
        parse("--dist-ckpt-strictness", "strict")


def test_enable_experimental_is_accepted_with_a_note():
    assert parse("--enable-experimental").legacy_notes == [
        "note: --enable-experimental changes nothing: megatrain has no experimental switch, each feature is on or "
        "off by its own flags"]


def test_auto_detect_ckpt_format_is_accepted_with_a_note():
    a = parse("--auto-detect-ckpt-format")
    assert any(n.startswith("note: --auto-detect-ckpt-format is always on here: --load reads") for n in a.legacy_notes)
