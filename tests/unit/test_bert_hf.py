"""BERT <-> Hugging Face MegatronBert: the exported model's masked-LM and sentence-order logits equal
ours (padding and token types included), HF -> megatrain matches transformers, round trips are exact,
the WordPiece vocab.txt travels both ways, refusals name what cannot convert, and the command lines."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from megatrain import checkpoint as checkpointing  # noqa: E402
from megatrain.checkpoint import TrainState  # noqa: E402
from megatrain.convert.export_hf import export_checkpoint, load_full_state_dict  # noqa: E402
from megatrain.convert.import_hf import import_hf_model  # noqa: E402
from megatrain.convert.tokenizer_files import write_hf_tokenizer  # noqa: E402
from megatrain.data.tokenizers import BertWordPieceTokenizer  # noqa: E402
from megatrain.models.bert.config import BertConfig  # noqa: E402
from megatrain.models.bert.hf import bert_config_from_hf, from_hf_state_dict, hf_architecture  # noqa: E402
from megatrain.models.bert.model import BertModel  # noqa: E402
from megatrain.models.common.hf_adapter import UnsupportedModelError  # noqa: E402
from megatrain.training.builders import padded_vocab_size  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# A small WordPiece vocabulary (cased and uncased words, every letter as a word and as a piece), filled
# up to exactly 128 lines: the tokenizer's vocabulary is the file's, padded to 128.
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "The", "cat", "sat", "on", "mat", "hello", "Hello", "world", "run", "##ning", "dog", "cafe",
         "naive", "resume", ".", ",", "!", "?", "'"]
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
VOCAB_LINES = SPECIAL + WORDS + LETTERS + ["##" + c for c in LETTERS] + [c.upper() for c in LETTERS[:10]]
VOCAB_LINES += [f"[unused{i}]" for i in range(128 - len(VOCAB_LINES))]
assert len(VOCAB_LINES) == 128
V = len(VOCAB_LINES)  # megatrain's tokenizer: the file's tokens, as Megatron-LM's
PADDED = padded_vocab_size(V, 128)  # 128
SENTENCES = ["The cat sat on the mat.", "Hello, world! Running dogs?", "Café naïve résumé", "HELLO the Dog's mat",
             "zebra quokka €"]

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=PADDED,
            max_position_embeddings=24, hidden_dropout=0.0, attention_dropout=0.0)
STYLES = {
    "binary_tanh": dict(gelu_approximation="tanh"),
    "binary_exact": dict(gelu_approximation="none"),
    "nobinary_tanh": dict(gelu_approximation="tanh", add_binary_head=False, num_tokentypes=0),
    "nobinary_exact": dict(gelu_approximation="none", add_binary_head=False, num_tokentypes=0),
    "untied": dict(gelu_approximation="tanh", untie_embeddings_and_output_weights=True),
    # exported as 1 + weight and zero biases: the same function, other parameters
    "layernorm_1p_no_bias": dict(gelu_approximation="none", apply_layernorm_1p=True, add_bias_linear=False),
}
EXACT_ROUND_TRIP = ["binary_tanh", "binary_exact", "nobinary_tanh", "nobinary_exact", "untied"]


def write_vocab(path: Path, lines: list[str] = VOCAB_LINES) -> Path:
    path.write_text("".join(t + "\n" for t in lines), encoding="utf-8")
    return path


def tokenizer_args(vocab: Path, lower: bool = True) -> argparse.Namespace:
    return argparse.Namespace(tokenizer_type="BertWordPieceLowerCase" if lower else "BertWordPieceCase",
                              vocab_file=str(vocab))


def random_model(style: str) -> BertModel:
    """A model whose every parameter (norms, biases, padding rows) is random, so no mapping hides."""
    torch.manual_seed(0)
    model = BertModel(BertConfig(**{**BASE, **STYLES[style]}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def save(model: BertModel, path: Path, args: argparse.Namespace) -> Path:
    """A checkpoint as the trainer writes one: the model, its config and the run's arguments."""
    checkpointing.save_checkpoint(str(path), TrainState(iteration=5), model, None, {}, args, model.config)
    return path


def load_bert(ckpt: Path) -> BertModel:
    path = checkpointing.find_checkpoint(str(ckpt))
    cfg = checkpointing.checkpoint_model_config(path, checkpointing.read_meta(path))
    model = BertModel(cfg)
    model.load_state_dict(load_full_state_dict(path, cfg))
    return model.eval()


def inputs(vocab: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """Three sequences of 13 tokens: one full, two padded at the end; segments A (0) and B (1)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, vocab, (3, 13), generator=g)
    mask = torch.ones_like(tokens)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    types = torch.zeros_like(tokens)
    types[:, 6:] = 1
    types[mask == 0] = 0
    tokens[mask == 0] = 0  # [PAD]
    return {"input_ids": tokens, "attention_mask": mask, "token_type_ids": types}


def ours(model: BertModel, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    with torch.no_grad():
        return model(x["input_ids"], x["attention_mask"], x["token_type_ids"])


def theirs(hf, x: dict[str, torch.Tensor]):
    with torch.no_grad():
        return hf(**x)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ------------------------------------------------------------------------------------------------
# export
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", list(STYLES))
def test_export_logits_match_transformers(style, tmp_path):
    model = random_model(style)
    vocab = write_vocab(tmp_path / "vocab.txt")
    export_checkpoint(str(save(model, tmp_path / "ckpt", tokenizer_args(vocab))), str(tmp_path / "hf"),
                      progress=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    binary = model.config.add_binary_head
    assert config["architectures"] == ["MegatronBertForPreTraining" if binary else "MegatronBertForMaskedLM"]
    assert config["model_type"] == "megatron-bert" and config["type_vocab_size"] == 2
    assert config["hidden_act"] == ("gelu_pytorch_tanh" if model.config.gelu_approximation == "tanh" else "gelu")
    assert config["vocab_size"] == V and config["pad_token_id"] == 0  # the tokenizer's size, not the padded 256
    assert config["tie_word_embeddings"] == (style != "untied")
    assert not (tmp_path / "hf" / "generation_config.json").exists()
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert weights["bert.embeddings.word_embeddings.weight"].shape[0] == V
    assert weights["cls.predictions.bias"].shape[0] == V

    x = inputs(V)
    lm, sop = ours(model, x)
    hf, info = transformers.MegatronBertForPreTraining.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32, output_loading_info=True)
    heads = {"bert.pooler.dense.weight", "bert.pooler.dense.bias", "cls.seq_relationship.weight",
             "cls.seq_relationship.bias"}
    assert set(info["missing_keys"]) == (set() if binary else heads) and not info["unexpected_keys"]
    out = theirs(hf.eval(), x)
    assert max_diff(lm[..., :V], out.prediction_logits) < 1e-4
    if binary:
        assert max_diff(sop, out.seq_relationship_logits) < 1e-4
    else:  # the class it was exported as loads completely
        masked, info = transformers.AutoModelForMaskedLM.from_pretrained(
            str(tmp_path / "hf"), dtype=torch.float32, output_loading_info=True)
        assert type(masked).__name__ == "MegatronBertForMaskedLM"
        assert not info["missing_keys"] and not info["unexpected_keys"]
        assert max_diff(lm[..., :V], theirs(masked.eval(), x).logits) < 1e-4
        # no token types here: the segment ids change nothing in the export either
        y = {**x, "token_type_ids": torch.zeros_like(x["token_type_ids"])}
        assert torch.equal(theirs(masked, y).logits, theirs(masked, x).logits)


@pytest.mark.parametrize("style", EXACT_ROUND_TRIP)
def test_export_then_import_gives_the_same_parameters(style, tmp_path):
    model = random_model(style)
    vocab = write_vocab(tmp_path / "vocab.txt")
    export_checkpoint(str(save(model, tmp_path / "ckpt", tokenizer_args(vocab))), str(tmp_path / "hf"),
                      progress=False)
    import_hf_model(str(tmp_path / "hf"), str(tmp_path / "back"))
    meta = checkpointing.read_meta(checkpointing.find_checkpoint(str(tmp_path / "back")))
    assert checkpointing.checkpoint_family(meta) == "bert"
    back = load_bert(tmp_path / "back")
    assert back.config == model.config
    original = model.state_dict()
    imported = back.state_dict()
    assert set(imported) == set(original)
    for name, value in original.items():
        if value.shape[:1] == (PADDED,):  # vocabulary rows: the tokenizer's are exact, the padding is zero
            assert torch.equal(imported[name][:V], value[:V]), name
            assert not imported[name][V:].any(), name
        else:
            assert torch.equal(imported[name], value), name

    flags = meta["args"]["pretrain_flags"]
    assert ("--bert-no-binary-head" in flags) == (not model.config.add_binary_head)
    assert ("--no-bias-gelu-fusion" in flags) == (model.config.gelu_approximation == "none")
    assert ("--untie-embeddings-and-output-weights" in flags) == (style == "untied")
    i = flags.index("--tokenizer-type")
    assert flags[i + 1] == "BertWordPieceLowerCase" and flags[i + 2] == "--vocab-file"
    assert Path(flags[i + 3]).read_text() == (tmp_path / "hf" / "vocab.txt").read_text()
    assert meta["args"]["hf_vocab_size"] == V

    # and out again: the same Hugging Face tensors, bit for bit
    export_checkpoint(str(tmp_path / "back"), str(tmp_path / "hf2"), progress=False)
    first, second = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "hf2"))
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)
    assert (tmp_path / "hf2" / "vocab.txt").read_text() == (tmp_path / "hf" / "vocab.txt").read_text()


# ------------------------------------------------------------------------------------------------
# import
# ------------------------------------------------------------------------------------------------
HF_VARIANTS = {
    "pretraining_gelu": dict(cls="MegatronBertForPreTraining", hidden_act="gelu", tie=True),
    "pretraining_gelu_new_untied": dict(cls="MegatronBertForPreTraining", hidden_act="gelu_new", tie=False),
    "maskedlm_gelu_pytorch_tanh": dict(cls="MegatronBertForMaskedLM", hidden_act="gelu_pytorch_tanh", tie=True),
}


def hf_folder(path: Path, variant: str, vocab_size: int = 90):
    spec = HF_VARIANTS[variant]
    cfg = transformers.MegatronBertConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
        max_position_embeddings=24, hidden_act=spec["hidden_act"], tie_word_embeddings=spec["tie"])
    torch.manual_seed(3)
    model = getattr(transformers, spec["cls"])(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        if spec["cls"] == "MegatronBertForMaskedLM":  # no token types in megatrain's BERT without the binary head
            types = model.bert.embeddings.token_type_embeddings.weight
            types.copy_(types[:1].expand_as(types))
        if not spec["tie"]:  # the unused copy of the untied decoder's bias, kept equal for the bitwise round trip
            model.cls.predictions.bias.copy_(model.cls.predictions.decoder.bias)
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_import_matches_transformers_and_exports_back(variant, tmp_path):
    src = tmp_path / "src"
    hf = hf_folder(src, variant)
    with pytest.warns(UserWarning, match="no tokenizer files found"):
        import_hf_model(str(src), str(tmp_path / "ckpt"))
    model = load_bert(tmp_path / "ckpt")
    binary = HF_VARIANTS[variant]["cls"] == "MegatronBertForPreTraining"
    assert model.config.add_binary_head == binary and model.config.vocab_size == 128
    assert model.config.gelu_approximation == ("none" if HF_VARIANTS[variant]["hidden_act"] == "gelu" else "tanh")
    assert model.config.norm_epsilon == 1e-12
    x = inputs(90)
    lm, sop = ours(model, x)
    out = theirs(hf, x)
    if binary:
        assert max_diff(lm[..., :90], out.prediction_logits) < 1e-4
        assert max_diff(sop, out.seq_relationship_logits) < 1e-4
    else:
        assert max_diff(lm[..., :90], out.logits) < 1e-4

    with pytest.warns(UserWarning, match="no --tokenizer-type"):  # the rows: the imported model's 90
        export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    original = load_file(str(src / "model.safetensors"))
    assert set(back) == set(original)
    for k, v in original.items():
        if variant.startswith("maskedlm") and "embeddings" in k and "word" not in k:
            continue  # the equal token-type rows moved into the position embeddings
        assert torch.equal(back[k], v), k
    again = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    assert max_diff(theirs(again, x).logits, theirs(hf, x)[0]) < 1e-4


def test_import_takes_the_wordpiece_vocabulary(tmp_path):
    """A transformers 5 folder (tokenizer.json only) and an older one (vocab.txt, cased): the vocab.txt
    megatrain trains with, the flags printed for pretrain_bert.py, the padding from the tokenizer's count."""
    src = tmp_path / "src"
    hf_folder(src, "pretraining_gelu", vocab_size=len(VOCAB_LINES))
    transformers.BertTokenizer(vocab={t: i for i, t in enumerate(VOCAB_LINES)}).save_pretrained(str(src))
    assert not (src / "vocab.txt").exists()
    import_hf_model(str(src), str(tmp_path / "ckpt"))
    meta = checkpointing.read_meta(checkpointing.find_checkpoint(str(tmp_path / "ckpt")))
    args = meta["args"]
    assert args["tokenizer_type"] == "BertWordPieceLowerCase"
    assert Path(args["vocab_file"]).read_text().splitlines() == VOCAB_LINES
    # 128 lines = 128 tokens: padded as pretrain_bert.py will pad them
    assert meta["model_config"]["vocab_size"] == 128 and args["hf_vocab_size"] == 128
    flags = args["pretrain_flags"]
    assert flags[flags.index("--tokenizer-type"):][:4] == ["--tokenizer-type", "BertWordPieceLowerCase",
                                                           "--vocab-file", args["vocab_file"]]
    # exported back: 128 rows again and the same 128-line vocab.txt
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["vocab_size"] == 128
    assert (tmp_path / "back" / "vocab.txt").read_text().splitlines() == VOCAB_LINES

    cased = tmp_path / "cased"
    hf_folder(cased, "maskedlm_gelu_pytorch_tanh", vocab_size=len(VOCAB_LINES))
    write_vocab(cased / "vocab.txt")
    (cased / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer",
                                                             "do_lower_case": False}))
    import_hf_model(str(cased), str(tmp_path / "ckpt_cased"))
    args = checkpointing.read_meta(checkpointing.find_checkpoint(str(tmp_path / "ckpt_cased")))["args"]
    assert args["tokenizer_type"] == "BertWordPieceCase" and "--bert-no-binary-head" in args["pretrain_flags"]


# ------------------------------------------------------------------------------------------------
# tokenizer files
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lower", [True, False])
def test_tokenizer_files_give_megatrains_ids(lower, tmp_path):
    vocab = write_vocab(tmp_path / "vocab.txt")
    ours_tok = BertWordPieceTokenizer(str(vocab), lower_case=lower)
    out = tmp_path / "hf"
    out.mkdir()
    special = write_hf_tokenizer(vars(tokenizer_args(vocab, lower)), str(out), 24, vocab_rows=ours_tok.vocab_size)
    assert special.pad_token_id == 0 and special.bos_token_id is None and "vocab.txt" in special.files
    for loader in (transformers.BertTokenizerFast, transformers.AutoTokenizer):
        tok = loader.from_pretrained(str(out))
        assert len(tok) == ours_tok.vocab_size and tok.pad_token_id == ours_tok.pad
        assert (tok.cls_token_id, tok.sep_token_id, tok.mask_token_id) == (ours_tok.cls, ours_tok.sep, ours_tok.mask)
        for text in SENTENCES:
            ids = ours_tok.tokenize(text)
            assert tok(text, add_special_tokens=False)["input_ids"] == ids, text
            assert tok(text)["input_ids"] == [ours_tok.cls, *ids, ours_tok.sep]
        pair = tok(SENTENCES[0], SENTENCES[1])
        n = len(ours_tok.tokenize(SENTENCES[0])) + 2
        assert pair["token_type_ids"] == [0] * n + [1] * (len(pair["input_ids"]) - n)
    assert (ours_tok.tokenize("The") == ours_tok.tokenize("the")) == lower


# ------------------------------------------------------------------------------------------------
# refusals
# ------------------------------------------------------------------------------------------------
HF_CONFIG = {"architectures": ["MegatronBertForPreTraining"], "model_type": "megatron-bert", "vocab_size": 90,
             "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 40}


def test_refusals():
    needs = {"position_embedding_type": "rope"}, {"normalization": "RMSNorm"}, {"swiglu": True}, \
        {"num_query_groups": 2}, {"kv_channels": 12}
    for change, phrase in zip(needs, ["learned absolute positions", "LayerNorm", "a GELU MLP",
                                      "no grouped-query attention", "head dim = hidden / heads"]):
        with pytest.raises(UnsupportedModelError, match=f"MegatronBertForPreTraining needs {phrase}"):
            hf_architecture(BertConfig(**{**BASE, **change}))
    with pytest.raises(UnsupportedModelError, match="MegatronBertForMaskedLM needs .*RMSNorm.*swiglu"):
        hf_architecture(BertConfig(**BASE, add_binary_head=False, num_tokentypes=0, normalization="RMSNorm",
                                   swiglu=True))
    assert hf_architecture(BertConfig(**BASE, apply_layernorm_1p=True, add_bias_linear=False)) \
        == "MegatronBertForPreTraining"

    assert bert_config_from_hf(HF_CONFIG, 128)[0].add_binary_head
    for change, message in [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
        ({"is_decoder": True}, "is_decoder=true"),
        ({"add_cross_attention": True}, "add_cross_attention=true"),
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"type_vocab_size": 3}, "type_vocab_size 3"),
        ({"hidden_size": 30}, "hidden_size 30 is not a multiple of num_attention_heads 4"),
        ({"architectures": ["MegatronBertForSequenceClassification"]},
         "MegatronBertForSequenceClassification'] is not supported"),
        ({"architectures": ["BertForMaskedLM"], "model_type": "bert"}, "original post-norm BERT"),
        ({"hidden_dropout_prob": 1.5}, "--hidden-dropout"),
    ]:
        with pytest.raises(UnsupportedModelError, match=message):
            bert_config_from_hf({**HF_CONFIG, **change}, 128)

    cfg, arch = bert_config_from_hf({**HF_CONFIG, "architectures": ["MegatronBertForMaskedLM"]}, 128)
    assert not cfg.add_binary_head and cfg.num_tokentypes == 0
    shape = {k: v for k, v in HF_CONFIG.items() if k not in ("architectures", "model_type")}
    hf = transformers.MegatronBertForMaskedLM(transformers.MegatronBertConfig(**shape)).state_dict()
    with pytest.raises(UnsupportedModelError, match="token_type_embeddings: the 2 rows .*differ"):
        from_hf_state_dict(hf, cfg, arch)
    hf["bert.embeddings.token_type_embeddings.weight"].zero_()
    from_hf_state_dict(hf, cfg, arch)
    with pytest.raises(UnsupportedModelError, match="no place for"):
        from_hf_state_dict({**hf, "bert.pooler.dense.weight": torch.zeros(32, 32)}, cfg, arch)
    del hf["bert.encoder.ln.bias"]
    with pytest.raises(UnsupportedModelError, match="no tensor 'bert.encoder.ln.bias'"):
        from_hf_state_dict(hf, cfg, arch)


def test_export_without_a_tokenizer_needs_the_vocab_size(tmp_path):
    model = random_model("binary_tanh")
    save(model, tmp_path / "ckpt", argparse.Namespace())
    with pytest.warns(UserWarning, match="no --tokenizer-type"), pytest.raises(ValueError, match="--vocab-size"):
        export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "hf"), progress=False)
    assert not (tmp_path / "hf").exists()
    with pytest.warns(UserWarning, match="no --tokenizer-type"):
        export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "hf"), progress=False, vocab_size=100)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 100


# ------------------------------------------------------------------------------------------------
# the command lines
# ------------------------------------------------------------------------------------------------
def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})


def check_export_cli(ckpt: Path, tmp_path: Path, model: BertModel) -> None:
    """tools/convert_checkpoint_to_hf.py gives a folder transformers loads with our logits, and
    `megatrain convert-from-hf` brings it back with the pretrain_bert.py flags."""
    proc = run("tools/convert_checkpoint_to_hf.py", "--checkpoint-path", str(ckpt), "--output-path",
               str(tmp_path / "hf"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "wrote MegatronBertForPreTraining" in proc.stdout and "vocab.txt" in proc.stdout
    vocab = len(BertWordPieceTokenizer(str(tmp_path / "hf" / "vocab.txt")).vocab)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == vocab
    hf = transformers.MegatronBertForPreTraining.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    x = inputs(vocab)
    lm, sop = ours(model, x)
    out = theirs(hf, x)
    assert max_diff(lm[..., :vocab], out.prediction_logits) < 1e-4 and max_diff(sop, out.seq_relationship_logits) < 1e-4
    tok = transformers.BertTokenizerFast.from_pretrained(str(tmp_path / "hf"))
    assert tok("the cat sat", add_special_tokens=False)["input_ids"] == \
        BertWordPieceTokenizer(str(tmp_path / "hf" / "vocab.txt")).tokenize("the cat sat")

    proc = run("-m", "megatrain", "convert-from-hf", "--hf-path", str(tmp_path / "hf"), "--save",
               str(tmp_path / "back"))
    assert proc.returncode == 0, proc.stderr
    assert "continue from it with pretrain_bert.py" in proc.stdout
    assert f"--tokenizer-type BertWordPieceLowerCase --vocab-file {tmp_path / 'back' / 'tokenizer' / 'vocab.txt'}" \
        in proc.stdout
    meta = checkpointing.read_meta(checkpointing.find_checkpoint(str(tmp_path / "back")))
    assert checkpointing.checkpoint_family(meta) == "bert"


@pytest.mark.long  # ~14 s: the same command lines run on pretrain_bert.py's checkpoint below
def test_command_lines_on_a_saved_checkpoint(tmp_path):
    model = random_model("binary_exact")
    vocab = write_vocab(tmp_path / "vocab.txt")
    check_export_cli(save(model, tmp_path / "ckpt", tokenizer_args(vocab)), tmp_path, model)


def test_command_lines_refuse_in_one_line(tmp_path):
    model = BertModel(BertConfig(**{**BASE, "position_embedding_type": "rope"}))
    save(model, tmp_path / "ckpt", tokenizer_args(write_vocab(tmp_path / "vocab.txt")))
    proc = run("tools/convert_checkpoint_to_hf.py", "--checkpoint-path", str(tmp_path / "ckpt"), "--output-path",
               str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: this BERT model has no exact Hugging Face")
    assert "Traceback" not in proc.stderr and not (tmp_path / "out" / "config.json").exists()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps({**HF_CONFIG, "position_embedding_type": "relative_key"}))
    proc = run("tools/convert_hf_to_checkpoint.py", "--hf-path", str(tmp_path / "src"), "--save", str(tmp_path / "c"))
    assert proc.returncode == 2 and "position_embedding_type 'relative_key'" in proc.stderr
    assert "Traceback" not in proc.stderr


# The real trainer with synthetic masked-LM samples (Megatron's BERT sample fields) in place of the
# dataset, so that the checkpoint is the trainer's own: its model, config and recorded arguments.
TRAINER_SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, {repo!r})
from megatrain.training.main import parse_family_args
from megatrain.training.trainer import Trainer, pretrain

SEQ = 16

def sample(i):
    g = np.random.default_rng(i)
    length = int(g.integers(8, SEQ + 1))
    split = int(g.integers(2, length - 1))
    text = g.integers(5, 100, SEQ)
    text[0], text[split - 1], text[length - 1] = 2, 3, 3  # [CLS] A [SEP] B [SEP]
    text[length:] = 0
    types = ((np.arange(SEQ) >= split) & (np.arange(SEQ) < length)).astype(np.int64)
    loss_mask = np.zeros(SEQ, np.int64)
    loss_mask[g.choice(np.arange(1, length - 1), 2, replace=False)] = 1
    labels = np.where(loss_mask == 1, text, -1)
    text = np.where(loss_mask == 1, 4, text)  # [MASK]
    return dict(text=text, types=types, labels=labels, is_random=int(g.integers(0, 2)),
                padding_mask=(np.arange(SEQ) < length).astype(np.int64), loss_mask=loss_mask, truncated=0)

class Samples:
    def __init__(self, n):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return sample(i)

class SyntheticTrainer(Trainer):
    def build_datasets(self, num_samples):
        return Samples(num_samples[0]), None, None

pretrain(parse_family_args("bert", sys.argv[1:]), trainer_class=SyntheticTrainer, family="bert")
"""


@pytest.mark.long
def test_command_lines_on_a_trainer_checkpoint(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.txt")
    script = tmp_path / "train_bert.py"
    script.write_text(TRAINER_SCRIPT.format(repo=str(REPO)))
    proc = run(str(script), "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
               "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
               "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-2", "--tokenizer-type",
               "BertWordPieceLowerCase", "--vocab-file", str(vocab), "--data-path", "unused", "--eval-iters", "0",
               "--num-workers", "0", "--device", "cpu", "--hidden-dropout", "0", "--attention-dropout", "0",
               "--save", str(tmp_path / "ckpt"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    model = load_bert(tmp_path / "ckpt")
    assert model.config.gelu_approximation == "tanh" and model.config.vocab_size == PADDED  # the trainer's defaults
    check_export_cli(tmp_path / "ckpt", tmp_path, model)


CORPUS = ["The cat sat on the mat.", "Hello, world!", "The dog sat on the cat.", "Running dogs sat.",
          "Hello the mat.", "A cat, a dog, a mat."]


@pytest.mark.skipif(importlib.util.find_spec("megatrain.data.bert_dataset") is None,
                    reason="pretrain_bert.py needs BERT's masked-LM data (megatrain/data/bert_dataset.py), "
                           "which is not in this checkout yet")
def test_command_lines_on_a_pretrain_bert_checkpoint(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.txt")
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for i in range(60):
            f.write(json.dumps({"text": " ".join(CORPUS[(i + j) % len(CORPUS)] for j in range(5))}) + "\n")
    tok = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(vocab)]
    proc = run("tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(tmp_path / "data"), *tok,
               "--split-sentences", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    proc = run("pretrain_bert.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
               "--seq-length", "24", "--max-position-embeddings", "24", "--micro-batch-size", "2",
               "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3", "--data-path",
               str(tmp_path / "data_text_sentence"), "--split", "100,0,0", *tok, "--eval-iters", "0",
               "--log-interval", "1", "--device", "cpu", "--num-workers", "0", "--hidden-dropout", "0",
               "--attention-dropout", "0", "--save", str(tmp_path / "ckpt"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    check_export_cli(tmp_path / "ckpt", tmp_path, load_bert(tmp_path / "ckpt"))
