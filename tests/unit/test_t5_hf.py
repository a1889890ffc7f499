"""T5 <-> Hugging Face T5ForConditionalGeneration: the exported model's logits equal ours on the same
encoder and decoder inputs (tied and untied, GELU and SwiGLU, with padding), export -> import -> export
is exact, the WordPiece vocabulary and its sentinels travel, the decoder start token is ours, and every
refusal is one line naming the flag."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from megatrain.convert import export_hf  # noqa: E402
from megatrain.convert.export_hf import export_checkpoint, load_full_state_dict  # noqa: E402
from megatrain.convert.import_hf import import_hf_model  # noqa: E402
from megatrain import checkpoint as checkpointing  # noqa: E402
from megatrain.data.tokenizers import build_tokenizer  # noqa: E402
from megatrain.inference.seq2seq import tokenize_with_sentinels  # noqa: E402
from megatrain.models.common.hf_adapter import UnsupportedModelError  # noqa: E402
from megatrain.models.t5.hf import t5_config_from_hf  # noqa: E402
from tests.unit.t5_tiny import CLS, PAD, PADDED, SEP, STYLES, V, random_model, save, write_vocab  # noqa: E402


VOCABULARY_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")


def inputs(seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Encoder [3, 11] and decoder [3, 7] tokens, some of each padded at the end."""
    g = torch.Generator().manual_seed(seed)
    enc, dec = torch.randint(5, V, (3, 11), generator=g), torch.randint(5, V, (3, 7), generator=g)
    enc_mask, dec_mask = torch.ones_like(enc), torch.ones_like(dec)
    enc_mask[1, 6:] = 0
    dec_mask[2, 4:] = 0
    return enc * enc_mask, dec * dec_mask, enc_mask, dec_mask


def export(model, tmp_path, name: str = "hf"):
    vocab = write_vocab(tmp_path / "vocab.txt")
    ckpt = save(model, tmp_path / f"ckpt_{name}", vocab)
    export_checkpoint(str(ckpt), str(tmp_path / name), progress=False)
    return tmp_path / name


@pytest.mark.parametrize("style", list(STYLES))
def test_exported_logits_match_transformers(style, tmp_path):
    model = random_model(style)
    out = export(model, tmp_path)
    config = json.loads((out / "config.json").read_text())
    tied = not model.config.untie_embeddings_and_output_weights
    assert config["architectures"] == ["T5ForConditionalGeneration"] and config["vocab_size"] == V
    assert config["feed_forward_proj"] == {"tied_gelu": "gelu", "tied_swiglu": "gated-silu",
                                           "untied_gelu_tanh": "gelu_new", "untied_swiglu": "gated-silu"}[style]
    assert config["tie_word_embeddings"] is tied and config["scale_decoder_outputs"] is tied
    assert (config["decoder_start_token_id"], config["eos_token_id"], config["pad_token_id"]) == (CLS, SEP, PAD)
    weights = load_file(str(out / "model.safetensors"))
    assert weights["shared.weight"].shape[0] == V and ("lm_head.weight" in weights) is not tied  # no padding rows

    hf = transformers.T5ForConditionalGeneration.from_pretrained(str(out)).eval()
    assert (hf.lm_head.weight.data_ptr() == hf.shared.weight.data_ptr()) is tied
    enc, dec, enc_mask, dec_mask = inputs()
    with torch.no_grad():
        ours = model(enc, dec, enc_mask, dec_mask)[..., :V]
        theirs = hf(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec,
                    decoder_attention_mask=dec_mask).logits
    assert theirs.shape == ours.shape
    real = dec_mask.bool()
    assert (ours - theirs)[real].abs().max().item() < 1e-4


@pytest.mark.parametrize("style", ["tied_swiglu", "untied_gelu_tanh"])
def test_export_import_export_is_exact(style, tmp_path):
    model = random_model(style)
    out = export(model, tmp_path)
    ckpt = import_hf_model(str(out), str(tmp_path / "back"))
    meta = checkpointing.read_meta(ckpt)
    cfg = checkpointing.checkpoint_model_config(ckpt, meta)
    assert meta["family"] == "t5" and cfg == model.config
    flags = meta["args"]["pretrain_flags"]
    for flag in ("--normalization", "--disable-bias-linear", "--decoder-num-layers", "--vocab-extra-ids"):
        assert flag in flags, flags
    assert meta["args"]["vocab_extra_ids"] == 4 and meta["args"]["tokenizer_type"] == "BertWordPieceLowerCase"
    back = load_full_state_dict(ckpt, cfg)
    for name, want in model.state_dict().items():
        got = back[name]
        if name in VOCABULARY_ROWS:  # the real rows, then zero padding (the export never had the rest)
            assert got.shape == want.shape == (PADDED, *want.shape[1:]), name
            assert torch.equal(got[:V], want[:V]) and not got[V:].any(), name
        else:
            assert torch.equal(got, want), name
    export_checkpoint(ckpt, str(tmp_path / "again"), progress=False)
    first, second = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "again" / "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_tokenizer_travels_with_its_sentinels(tmp_path):
    out = export(random_model("tied_gelu"), tmp_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = build_tokenizer({"tokenizer_type": "BertWordPieceLowerCase", "vocab_file": str(tmp_path / "vocab.txt"),
                            "vocab_extra_ids": 4})
    text = "The cat <extra_id_0> on the mat. <extra_id_1> zebra"
    assert hf_tok(text, add_special_tokens=False).input_ids == tokenize_with_sentinels(ours, text)
    assert tokenize_with_sentinels(ours, text).count(ours.additional_special_tokens_ids[0]) == 1
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["decoder_start_token_id"] == CLS and generation["eos_token_id"] == SEP


def test_refusals_are_one_line_naming_the_flag(tmp_path, capsys):
    vocab = write_vocab(tmp_path / "vocab.txt")
    for n, (overrides, flags) in enumerate([
        (dict(position_embedding_type="learned_absolute"), ["--position-embedding-type relative"]),
        (dict(position_embedding_type="rope", normalization="LayerNorm", add_bias_linear=True),
         ["--position-embedding-type relative", "--normalization RMSNorm", "--disable-bias-linear"]),
    ]):
        ckpt = save(random_model("tied_gelu", **overrides), tmp_path / f"c{n}", vocab)
        with pytest.raises(SystemExit):
            export_hf.main(["--checkpoint-path", str(ckpt), "--output-path", str(tmp_path / f"o{n}"), "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and all(f in err for f in flags), err
    biased = random_model("tied_gelu")
    with torch.no_grad():
        biased.output_layer.bias[5] = 0.5
    with pytest.raises(UnsupportedModelError, match="--untie-embeddings-and-output-weights"):
        export_checkpoint(str(save(biased, tmp_path / "biased", vocab)), str(tmp_path / "ob"), progress=False)
    assert not (tmp_path / "ob").exists()  # refused before anything was written
    with torch.no_grad():  # the padding rows' bias is not exported, so it may be anything
        biased.output_layer.bias.zero_()
        biased.output_layer.bias[V:] = 1.0
    export_checkpoint(str(save(biased, tmp_path / "pad_bias", vocab)), str(tmp_path / "op"), progress=False)


@pytest.mark.parametrize("hf_config, message", [
    ({"feed_forward_proj": "relu"}, "ReLU"),
    ({"feed_forward_proj": "gated-gelu"}, "gated GELU"),
    ({"architectures": ["T5EncoderModel"]}, "T5ForConditionalGeneration"),
])
def test_import_refuses_what_megatrain_cannot_compute(hf_config, message):
    base = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": 64, "num_heads": 4,
            "d_kv": 16, "d_ff": 96, "num_layers": 2, "feed_forward_proj": "gated-silu"}
    t5_config_from_hf(base, 128)  # the base converts
    with pytest.raises(UnsupportedModelError, match=message):
        t5_config_from_hf({**base, **hf_config}, 128)


def test_random_transformers_t5_imports_with_its_logits(tmp_path):
    """A T5 v1.1-layout model built by transformers (untied, unscaled, SwiGLU) converts exactly."""
    hf_cfg = transformers.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=1,
                                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                   feed_forward_proj="gated-silu", tie_word_embeddings=False, dropout_rate=0.0,
                                   decoder_start_token_id=CLS)
    torch.manual_seed(3)
    hf = transformers.T5ForConditionalGeneration(hf_cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight = torch.nn.Parameter(torch.randn(V, 64))  # its own lm_head
    hf.save_pretrained(str(tmp_path / "hf"))
    with pytest.warns(UserWarning, match="no tokenizer files"):
        ckpt = import_hf_model(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    cfg = checkpointing.checkpoint_model_config(ckpt, checkpointing.read_meta(ckpt))
    from megatrain.models.t5 import T5Model

    model = T5Model(cfg)
    model.load_state_dict(load_full_state_dict(ckpt, cfg))
    enc, dec, enc_mask, dec_mask = inputs(2)
    with torch.no_grad():
        theirs = hf(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec,
                    decoder_attention_mask=dec_mask).logits
        ours = model.eval()(enc, dec, enc_mask, dec_mask)[..., :V]
    assert cfg.untie_embeddings_and_output_weights and cfg.decoder_layers == 1
    assert (ours - theirs)[dec_mask.bool()].abs().max().item() < 1e-4

    # finetune.py on the imported checkpoint: the model flags default to the ones the import printed
    from megatrain.training.finetune_seq2seq import _fill_pairs, build_parser, saved_run_args

    meta = checkpointing.read_meta(ckpt)
    args = build_parser(meta).parse_args(["--encoder-seq-length", "16", "--decoder-seq-length", "8"])
    _fill_pairs(args, saved_run_args(meta))
    shape = (args.encoder_num_layers, args.decoder_num_layers, args.hidden_size, args.num_attention_heads)
    assert shape == (2, 1, 64, 4)
    assert args.swiglu and not args.add_bias_linear and args.untie_embeddings_and_output_weights
    assert args.position_embedding_type == "relative" and args.normalization == "RMSNorm"

