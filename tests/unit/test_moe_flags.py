"""The mixture-of-experts flags and config: Megatron's names and defaults, the --moe-layer-freq
parser (no eval), and each bad setting refused with a message naming its flag."""

from __future__ import annotations

import pytest

from megatrain.models.common.config import TransformerConfig, check_moe_layer_freq, parse_moe_layer_freq
from megatrain.models.gpt.config import gpt_config_from_args
from megatrain.training.arguments import parse_args, validate_args

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data"]


def parse(*extra: str):
    return validate_args(parse_args([*BASE, *extra], validate=False), world_size=1)


def test_megatron_defaults_and_a_dense_model_by_default():
    a = parse()
    assert a.num_experts is None and a.moe_router_topk == 2 and a.moe_router_score_function == "softmax"
    assert a.moe_router_load_balancing_type == "aux_loss" and a.moe_aux_loss_coeff == 0.0
    assert a.moe_z_loss_coeff is None and a.moe_layer_freq == 1 and a.moe_router_bias_update_rate == 1e-3
    assert a.moe_token_drop_policy == "probs" and a.moe_expert_capacity_factor is None
    cfg = gpt_config_from_args(a, 128)
    assert cfg.num_moe_experts is None and not any(cfg.is_moe_layer(i) for i in range(4))
    assert parse("--num-experts", "0").num_experts is None  # Megatron: 0 means none


def test_flags_fill_the_config():
    a = parse("--num-experts", "8", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "4",
              "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "4",
              "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor", "2.5",
              "--moe-router-enable-expert-bias", "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0.01",
              "--moe-z-loss-coeff", "1e-3", "--moe-layer-freq", "([0]*1+[1]*3)",
              "--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate",
              "--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy", "position")
    cfg = gpt_config_from_args(a, 128)
    assert cfg.num_moe_experts == 8 and cfg.moe_ffn == 32 and cfg.moe_router_topk == 4
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (4, 2)
    assert cfg.moe_aux_loss_coeff == 0.01 and cfg.moe_router_dtype == "fp32"
    assert cfg.moe_layer_freq == [0, 1, 1, 1] and [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert cfg.num_moe_layers == 3 and cfg.moe_shared_expert_gate and cfg.moe_expert_capacity_factor == 1.5
    every_other = gpt_config_from_args(parse("--num-experts", "4", "--moe-layer-freq", "2"), 128)
    assert [every_other.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    assert every_other.moe_ffn == every_other.ffn_hidden_size == every_other.moe_ffn_hidden_size


def test_list_valued_balancing_flags():
    a = parse("--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
              "--moe-aux-loss-coeff", "0.01", "0.001")
    cfg = gpt_config_from_args(a, 128)
    assert cfg.moe_router_load_balancing_type == ["aux_loss", "seq_aux_loss"]
    assert cfg.aux_loss_coeff("seq_aux_loss") == 0.001


@pytest.mark.parametrize("text,expected", [
    ("1", 1), ("3", 3), ("[1,0,1]", [1, 0, 1]), ("([0]*3+[1]*2)", [0, 0, 0, 1, 1]),
    ("([1]*3+[0]*1)*2", [1, 1, 1, 0, 1, 1, 1, 0]), ("2*[0, 1]", [0, 1, 0, 1]), (" [ 1 ] ", [1]),
])
def test_layer_freq_expressions(text, expected):
    assert parse_moe_layer_freq(text) == expected


@pytest.mark.parametrize("text", [
    "__import__('os').system('true')", "[1]*[2]", "[1]+2", "", "[1,", "[1]]", "1e3", "[-1]", "[0x1]",
    "[1]*10**9", "[1]*100000000", "(" * 200 + "1" + ")" * 200, "[1];[0]", "lambda: 1",
])
def test_layer_freq_refuses_anything_else(text):
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        parse_moe_layer_freq(text)


def test_layer_freq_flag_error_is_one_argparse_line(capsys):
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--moe-layer-freq", "__import__('os')"], validate=False)
    assert "argument --moe-layer-freq: unexpected '_'" in capsys.readouterr().err


def test_layer_freq_values_checked():
    assert check_moe_layer_freq((1, 0), 2) == [1, 0]
    for bad, n in (([1, 0, 1], 2), ([1, 2], 2), (0, 2), ([True, False], 2), ("x", 2)):
        with pytest.raises(ValueError, match="--moe-layer-freq"):
            check_moe_layer_freq(bad, n)


@pytest.mark.parametrize("fields,flag", [
    (dict(moe_router_topk=9), "--moe-router-topk"),
    (dict(moe_router_topk=0), "--moe-router-topk"),
    (dict(moe_router_topk=1), "--moe-router-pre-softmax"),
    (dict(moe_router_group_topk=2), "--moe-router-num-groups"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "--moe-router-num-groups"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=3), "--moe-router-group-topk"),
    (dict(moe_router_topk=3, moe_router_num_groups=2, moe_router_group_topk=2), "--moe-router-topk"),
    (dict(moe_router_score_function="tanh"), "--moe-router-score-function"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "--moe-router-load-balancing-type sinkhorn"),
    (dict(moe_router_load_balancing_type="bogus"), "--moe-router-load-balancing-type"),
    (dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=0.1),
     "--moe-aux-loss-coeff"),
    (dict(moe_aux_loss_coeff=-1.0), "--moe-aux-loss-coeff"),
    (dict(moe_z_loss_coeff=-1.0), "--moe-z-loss-coeff"),
    (dict(moe_router_dtype="bf16"), "--moe-router-dtype"),
    (dict(moe_token_drop_policy="random"), "--moe-token-drop-policy"),
    (dict(moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor"),
    (dict(moe_pad_expert_input_to_capacity=True), "--moe-expert-capacity-factor"),
    (dict(moe_router_enable_expert_bias=True), "--moe-router-score-function"),
    (dict(moe_shared_expert_intermediate_size=0), "--moe-shared-expert-intermediate-size"),
    (dict(moe_shared_expert_gate=True), "--moe-shared-expert-intermediate-size"),
    (dict(moe_ffn_hidden_size=0), "--moe-ffn-hidden-size"),
    (dict(moe_layer_freq=[1, 0]), "--moe-layer-freq"),
    (dict(moe_input_jitter_eps=1.5), "--moe-input-jitter-eps"),
    (dict(num_moe_experts=-2), "--num-experts"),
])
def test_bad_settings_name_their_flag(fields, flag):
    fields = {"num_moe_experts": 8, **fields}
    with pytest.raises(ValueError) as e:
        TransformerConfig(num_layers=4, **fields)
    assert flag in str(e.value)


def test_negative_capacity_factor_means_dropless_as_megatron():
    assert TransformerConfig(num_moe_experts=4, moe_expert_capacity_factor=-1.0).moe_expert_capacity_factor is None


def test_moe_ffn_without_experts_is_refused():
    with pytest.raises(ValueError, match="--moe-ffn-hidden-size"):
        TransformerConfig(moe_ffn_hidden_size=32)


def test_cli_errors_are_one_line():
    with pytest.raises(SystemExit) as e:
        parse("--num-experts", "4", "--moe-router-topk", "5")
    assert "--moe-router-topk must be between 1 and --num-experts (4)" in str(e.value.code)


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_bert_and_t5_refuse_experts(family):
    from megatrain.training.main import parse_family_args

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--num-experts", "4"]
    if family == "t5":
        argv += ["--encoder-seq-length", "32", "--decoder-seq-length", "16"]
    with pytest.raises(SystemExit) as e:
        parse_family_args(family, argv)
    assert "--num-experts" in str(e.value.code) and "pretrain_gpt.py" in str(e.value.code)


def test_megatron_moe_fusion_switches_are_accepted_with_a_note_and_upcycling_refused(capsys):
    a = parse_args([*BASE, "--num-experts", "4", "--moe-permute-fusion", "--moe-router-fusion"], validate=False)
    assert any("--moe-permute-fusion" in n for n in a.legacy_notes)
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--moe-use-upcycling"], validate=False)
    assert "upcycling" in capsys.readouterr().err
