"""The T5 family's model, objective, FLOPs and flags against written-out references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatrain.models.common.relative_position import relative_position_bucket
from megatrain.models.registry import get_family
from megatrain.models.t5 import T5Config, T5Model
from megatrain.models.t5.objective import Seq2SeqObjective

H, N, V, S_ENC, S_DEC = 32, 4, 96, 12, 8


def _cfg(**kw) -> T5Config:
    base = dict(num_layers=2, decoder_num_layers=3, hidden_size=H, num_attention_heads=N, vocab_size=V,
                max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, gelu_approximation="none",
                relative_attention_num_buckets=8, relative_attention_max_distance=10)
    base.update(kw)
    return T5Config(**base)


def _samples(b=3, seed=0):
    """T5-dataset-shaped samples (Megatron's field names) with encoder and decoder padding."""
    g = torch.Generator().manual_seed(seed)
    enc = torch.randint(5, V, (b, S_ENC), generator=g)
    dec = torch.randint(5, V, (b, S_DEC), generator=g)
    labels = torch.randint(5, V, (b, S_DEC), generator=g)
    enc_mask, dec_mask = torch.ones(b, S_ENC, dtype=torch.long), torch.ones(b, S_DEC, dtype=torch.long)
    enc_mask[0, 9:] = 0
    dec_mask[1, 5:] = 0
    enc, dec = enc * enc_mask, dec * dec_mask
    labels = torch.where(dec_mask == 1, labels, torch.full_like(labels, -1))
    return {"text_enc": enc, "text_dec": dec, "labels": labels, "loss_mask": dec_mask.clone(),
            "enc_mask": enc_mask, "dec_mask": dec_mask, "truncated": torch.zeros(b, dtype=torch.long)}


def _bucket(rel: int, bidirectional: bool, buckets: int, max_distance: int) -> int:
    """T5's relative-position bucket of one key-minus-query distance, in plain Python."""
    offset = 0
    if bidirectional:
        buckets //= 2
        offset = buckets if rel > 0 else 0
        distance = abs(rel)
    else:
        distance = max(-rel, 0)
    exact = buckets // 2
    if distance < exact:
        return offset + distance
    far = exact + int(math.log(distance / exact) / math.log(max_distance / exact) * (buckets - exact))
    return offset + min(far, buckets - 1)


def _reference_logits(model: T5Model, enc, dec, enc_mask, dec_mask) -> torch.Tensor:
    """Megatron's T5 written out with plain tensor operations on the model's weights: pre-LN layers,
    relative position bias added to the scaled self-attention scores, cross-attention over the encoder
    output, final norms, tied output layer with a bias."""
    cfg = model.config
    d = cfg.kv_channels
    words = model.embedding.word_embeddings.weight

    def norm(x, m):
        return F.layer_norm(x, (H,), m.weight, m.bias, cfg.norm_epsilon)

    def heads(x):  # [b, s, n d] -> [b, n, s, d]
        return x.view(x.shape[0], x.shape[1], N, d).transpose(1, 2)

    def attend(q, k, v, add):
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + add, dim=-1)
        return (p @ v).transpose(1, 2).reshape(q.shape[0], q.shape[2], N * d)

    def bias_of(table, s, bidirectional):
        ids = torch.tensor([[_bucket(j - i, bidirectional, cfg.relative_attention_num_buckets,
                                     cfg.relative_attention_max_distance) for j in range(s)] for i in range(s)])
        return table.relative_attention_bias.weight[ids].permute(2, 0, 1).unsqueeze(0)

    def hide(keep):  # bool -> 0 / -inf
        return torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))

    def self_attn(x, att, add):
        w = att.linear_qkv.weight.view(N, 3, d, H)
        bq = att.linear_qkv.bias.view(N, 3, d)
        q, k, v = (heads(x @ w[:, i].reshape(N * d, H).T + bq[:, i].reshape(-1)) for i in range(3))
        return attend(q, k, v, add) @ att.linear_proj.weight.T + att.linear_proj.bias

    def mlp(x, m):
        return F.gelu(x @ m.linear_fc1.weight.T + m.linear_fc1.bias) @ m.linear_fc2.weight.T + m.linear_fc2.bias

    enc_keys = hide(enc_mask.bool()[:, None, None, :])
    x = words[enc]
    add = bias_of(model.encoder_relative_pos_emb, S_ENC, True) + enc_keys
    for layer in model.encoder.layers.values():
        x = x + self_attn(norm(x, layer.input_layernorm), layer.self_attention, add)
        x = x + mlp(norm(x, layer.pre_mlp_layernorm), layer.mlp)
    memory = norm(x, model.encoder.final_layernorm)

    y = words[dec]
    causal = torch.ones(S_DEC, S_DEC, dtype=torch.bool).tril()
    add = bias_of(model.decoder_relative_pos_emb, S_DEC, False) + hide(causal & dec_mask.bool()[:, None, None, :])
    for layer in model.decoder.layers.values():
        y = y + self_attn(norm(y, layer.input_layernorm), layer.self_attention, add)
        cross = layer.cross_attention
        kv = (memory @ cross.linear_kv.weight.T + cross.linear_kv.bias).view(*memory.shape[:2], N, 2, d)
        q = heads(norm(y, layer.pre_cross_attn_layernorm) @ cross.linear_q.weight.T + cross.linear_q.bias)
        out = attend(q, kv[..., 0, :].transpose(1, 2), kv[..., 1, :].transpose(1, 2), enc_keys)
        y = y + out @ cross.linear_proj.weight.T + cross.linear_proj.bias
        y = y + mlp(norm(y, layer.pre_mlp_layernorm), layer.mlp)
    return norm(y, model.decoder.final_layernorm) @ words.T + model.output_layer.bias


def test_forward_equals_written_out_t5_with_relative_positions():
    torch.manual_seed(0)
    model = T5Model(_cfg(position_embedding_type="relative"))
    with torch.no_grad():  # every bias nonzero, so a bias in the wrong place shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "relative" in name:
                p.normal_(0, 0.1)
    s = _samples()
    got = model(s["text_enc"], s["text_dec"], s["enc_mask"], s["dec_mask"])
    want = _reference_logits(model, s["text_enc"], s["text_dec"], s["enc_mask"], s["dec_mask"])
    real = s["dec_mask"].bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_relative_position_buckets_follow_t5():
    rel = torch.arange(-300, 301)
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (8, 10)):
            got = relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=buckets, max_distance=distance)
            assert got.tolist() == [_bucket(r, bidirectional, buckets, distance) for r in rel.tolist()]
    # a few of T5's values (32 buckets, max distance 128): keys after the query take the upper half
    ids = relative_position_bucket(torch.tensor([0, 1, -1, -8, -20, -1000]), bidirectional=True, num_buckets=32,
                                   max_distance=128)
    assert ids.tolist() == [0, 17, 1, 8, 10, 15]
    ids = relative_position_bucket(torch.tensor([5, 0, -1, -20, -1000]), bidirectional=False, num_buckets=32,
                                   max_distance=128)
    assert ids.tolist() == [0, 0, 1, 17, 31]


def test_loss_is_the_mean_cross_entropy_over_the_loss_mask():
    model = T5Model(_cfg(untie_embeddings_and_output_weights=True))
    s = _samples()
    objective = Seq2SeqObjective()
    batch = objective.make_batch(s)
    (loss_sum, count), = objective.losses(objective.forward(model, batch), objective.loss_target(batch))
    logits = model(s["text_enc"], s["text_dec"], s["enc_mask"], s["dec_mask"])
    mask = s["loss_mask"].bool()
    assert (loss_sum / count).item() == pytest.approx(F.cross_entropy(logits[mask], s["labels"][mask]).item(), rel=1e-6)
    assert count.item() == mask.sum().item()
    assert model.output_layer.bias is None and model.output_weight() is model.output_layer.weight


@pytest.mark.parametrize("position", ["learned_absolute", "rope"])
def test_padding_is_invisible_the_decoder_causal_and_the_encoder_seen_whole(position):
    model = T5Model(_cfg(position_embedding_type=position))
    s = _samples()
    enc, dec, em, dm = s["text_enc"], s["text_dec"], s["enc_mask"], s["dec_mask"]
    logits = model(enc, dec, em, dm)
    other_pads = model(enc.masked_fill(em == 0, 7), dec.masked_fill(dm == 0, 7), em, dm)
    real = dm.bool()
    torch.testing.assert_close(other_pads[real], logits[real])
    later = dec.clone()
    later[:, 4] = (later[:, 4] + 1) % V
    changed = model(enc, later, em, dm)
    torch.testing.assert_close(changed[:, :4], logits[:, :4])
    assert not torch.allclose(changed[2, 4], logits[2, 4])
    last = enc.clone()
    last[2, -1] = (last[2, -1] + 1) % V
    assert not torch.allclose(model(last, dec, em, dm)[2, 0], logits[2, 0])


def test_initialisation_rules_and_parameter_counts():
    cfg = _cfg(position_embedding_type="relative", num_layers=2, decoder_num_layers=8)
    model = T5Model(cfg)
    params = dict(model.named_parameters())
    std = cfg.init_method_std
    for name, want in (("encoder.layers.0.mlp.linear_fc2.weight", std / math.sqrt(2 * 2)),
                       ("decoder.layers.0.mlp.linear_fc2.weight", std / math.sqrt(2 * 8)),
                       ("decoder.layers.1.cross_attention.linear_proj.weight", std / math.sqrt(2 * 8)),
                       ("decoder.layers.1.cross_attention.linear_kv.weight", std),
                       ("decoder_relative_pos_emb.relative_attention_bias.weight", std)):
        assert params[name].std().item() == pytest.approx(want, rel=0.3), name
    assert model.output_layer.bias.abs().max() == 0 and model.output_layer.weight is None
    assert torch.all(params["decoder.layers.2.pre_cross_attn_layernorm.weight"] == 1)
    assert params["encoder_relative_pos_emb.relative_attention_bias.weight"].shape == (8, N)
    assert model.embedding.position_embeddings is None
    assert model.num_parameters() - model.num_parameters(exclude_embeddings=True) == V * H
    learned = T5Model(_cfg())
    assert learned.encoder_relative_pos_emb is None and learned.embedding.position_embeddings.weight.shape == (16, H)


def test_flops_are_the_counted_matmuls_with_half_the_decoder_scores():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    for kw in (dict(), dict(swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True)):
        cfg = _cfg(decoder_seq_length=S_DEC, kv_channels=16, **kw)  # head dim 16 != h / n
        model = T5Model(cfg)
        s = _samples(b=2)
        counter = FlopCounterMode(display=False)
        with counter, sdpa_kernel(SDPBackend.MATH):
            model(s["text_enc"], s["text_dec"], s["enc_mask"], s["dec_mask"]).float().sum().backward()
        masked_half = 6 * 2 * S_DEC * S_DEC * cfg.decoder_layers * N * 16  # causal: Megatron counts half
        assert counter.get_total_flops() == get_family("t5").flops(cfg, 2, S_ENC) + masked_half


def test_recomputation_wraps_both_stacks():
    from megatrain.parallel.recompute import RecomputeConfig, apply_activation_checkpointing

    model = T5Model(_cfg())
    s = _samples()
    want = model(s["text_enc"], s["text_dec"], s["enc_mask"], s["dec_mask"])
    wrapped = apply_activation_checkpointing(model, RecomputeConfig("selective"))
    assert "decoder.layers.2.cross_attention.core_attention" in wrapped and len(wrapped) == 2 + 3 * 2
    block = T5Model(_cfg())
    assert apply_activation_checkpointing(block, RecomputeConfig("full", "block", 1)) == ["encoder.layers.0",
                                                                                           "decoder.layers.0"]
    torch.testing.assert_close(model(s["text_enc"], s["text_dec"], s["enc_mask"], s["dec_mask"]), want)


T5_BASE = ["--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "2", "--train-iters", "2",
           "--lr", "1e-4", "--vocab-extra-ids", "10"]


def _t5_args(tmp_path, *flags):
    from megatrain.training.main import parse_family_args

    return parse_family_args("t5", [*T5_BASE, "--data-path", str(tmp_path / "x"), "--vocab-file",
                                    str(tmp_path / "v.txt"), *flags])


def test_t5_flags_fill_the_general_ones(tmp_path):
    a = _t5_args(tmp_path, "--num-layers", "3", "--seq-length", "32", "--decoder-seq-length", "16")
    assert (a.num_layers, a.encoder_num_layers, a.decoder_num_layers) == (3, 3, 3)
    assert (a.seq_length, a.encoder_seq_length, a.max_position_embeddings) == (32, 32, 32)
    a = _t5_args(tmp_path, "--encoder-num-layers", "2", "--decoder-num-layers", "4", "--encoder-seq-length", "16",
                 "--decoder-seq-length", "24", "--position-embedding-type", "relative")
    assert (a.num_layers, a.decoder_num_layers, a.seq_length, a.max_position_embeddings) == (2, 4, 16, 24)
    assert a.tokenizer_type == "BertWordPieceLowerCase"
    cfg = get_family("t5").config_from_args(a, 128)
    assert (cfg.num_layers, cfg.decoder_layers, cfg.position_embedding_type, cfg.decoder_seq_length) == (
        2, 4, "relative", 24)


GOOD = ["--encoder-num-layers", "2", "--encoder-seq-length", "16", "--decoder-seq-length", "8"]


@pytest.mark.parametrize("flags, message", [
    (["--vocab-extra-ids", "0"], "--vocab-extra-ids 0: T5's span corruption"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer: T5's span corruption needs"),
    (["--decoder-seq-length", "32", "--max-position-embeddings", "16"],
     "--decoder-seq-length (32) is larger than --max-position-embeddings (16)"),
    (["--encoder-seq-length", "32", "--max-position-embeddings", "16"],
     "--encoder-seq-length (32) is larger than --max-position-embeddings (16)"),
    (["--num-layers", "3"], "give --num-layers (3) or --encoder-num-layers (2), not both"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size > 1 is not supported for T5"),
    (["--context-parallel-size", "2"], "--context-parallel-size > 1 is not supported for T5"),
    (["--mock-data"], "--mock-data: there is no mock T5 dataset"),
    (["--group-query-attention", "--num-query-groups", "2"], "--group-query-attention is not supported for T5"),
    (["--position-embedding-type", "relative", "--relative-attention-num-buckets", "2"],
     "--relative-attention-num-buckets must be at least 4"),
    (["--eod-mask-loss"], "--eod-mask-loss: not used by T5"),
])
def test_pretrain_t5_refuses_with_one_line(flags, message, tmp_path):
    with pytest.raises(SystemExit) as e:
        _t5_args(tmp_path, *GOOD, *flags)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_decoder_length_is_required(tmp_path):
    with pytest.raises(SystemExit, match="--decoder-seq-length is required"):
        _t5_args(tmp_path, "--encoder-num-layers", "2", "--encoder-seq-length", "16")


@pytest.mark.parametrize("flag", ["--encoder-num-layers", "--decoder-seq-length"])
def test_pretrain_gpt_points_t5_flags_to_pretrain_t5(flag, capsys):
    from megatrain.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                    "--micro-batch-size", "2", "--train-iters", "1", "--mock-data", flag, "8"])
    assert f"{flag}: a T5 (encoder-decoder) flag: train T5 with pretrain_t5.py" in capsys.readouterr().err


def test_the_family_is_registered():
    family = get_family("t5")
    assert family.flag_defaults == {"tokenizer_type": "BertWordPieceLowerCase"}
    assert {"decoder_num_layers", "relative_attention_num_buckets", "hidden_size"} <= set(family.config_checks)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size"):
        family.build_stage(_cfg(), [0], stage_index=0, num_stages=2)


def test_every_config_field_has_a_checkpoint_check_and_a_flag():
    """As for GPT: each T5Config field is placed in the family's table, its flag is one of
    pretrain_t5.py's, and each compared one (but the padded vocabulary) is a flag's dest, so
    --use-checkpoint-args can take it from a T5 checkpoint."""
    from dataclasses import fields

    from megatrain.training.arguments import CONFIG_FIELD_DESTS
    from megatrain.training.main import family_parser

    checks = get_family("t5").config_checks
    assert set(checks) == {f.name for f in fields(T5Config)}
    parser = family_parser("t5")
    dests = {a.dest for a in parser._actions}
    options = {o for a in parser._actions for o in a.option_strings}
    for name, check in checks.items():
        assert check.flag in options, check.flag
        if check.how == "compare" and name != "vocab_size":
            assert CONFIG_FIELD_DESTS.get(name, name) in dests, name


def test_a_bad_bias_gradient_choice_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_T5_BIAS_GRADIENT", "fast")
    with pytest.raises(SystemExit) as e:
        _t5_args(tmp_path, *GOOD)
    assert "MEGATRAIN_T5_BIAS_GRADIENT must be auto, mask, recompute, got 'fast'" in str(e.value)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("MEGATRAIN_T5_BIAS_GRADIENT", "recompute")
    assert _t5_args(tmp_path, *GOOD, "--position-embedding-type", "relative") is not None
    monkeypatch.setenv("MEGATRAIN_BIAS_GRAD_LSE_TILE", "big")
    with pytest.raises(SystemExit) as e:
        _t5_args(tmp_path, *GOOD)
    assert "MEGATRAIN_BIAS_GRAD_LSE_TILE must be BMxBNwW" in str(e.value) and "\n" not in str(e.value)
