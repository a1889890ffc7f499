"""Fill-mask inference (megatrain/inference/fill_mask.py) on a BERT checkpoint whose masked-LM head is
arranged so that the answer is known: the transform outputs zeros, so the logits are the output
bias, and the probabilities are its softmax over the tokenizer's vocabulary (the embedding table's
padding rows left out). One-line errors for a text without [MASK], a GPT checkpoint and a
classification checkpoint; tools/generate.py on a BERT checkpoint points to fill-mask."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import TrainState
from megatrain.data.tokenizers.wordpiece import BertWordPieceTokenizer
from megatrain.inference import fill_mask as fm
from megatrain.models.bert import BertConfig, BertModel
from megatrain.models.bert.classification import BertClassificationModel, classification_config

WORDS = ["the", "cat", "dog", "sat", "on", "mat"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS  # 11 tokens, padded to 16
PADDED = 16


def _config(**kw) -> BertConfig:
    return BertConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=PADDED,
                      max_position_embeddings=12, hidden_dropout=0.0, attention_dropout=0.0, **kw)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fill_mask")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    tok = BertWordPieceTokenizer(str(vocab))
    args = argparse.Namespace(tokenizer_type="BertWordPieceLowerCase", vocab_file=str(vocab))

    model = BertModel(_config())
    model.init_weights(seed=3)
    with torch.no_grad():
        model.lm_head.dense.weight.zero_()  # the transform's output is LayerNorm(0) = 0 ...
        model.lm_head.dense.bias.zero_()
        bias = torch.zeros(PADDED)  # ... so the logits are the output bias
        bias[tok.vocab["cat"]], bias[tok.vocab["dog"]], bias[tok.vocab["mat"]] = 6.0, 5.0, 4.0
        bias[PADDED - 1] = 100.0  # a padding row of the table: never a prediction
        model.output_layer.bias.copy_(bias)
    bert = checkpointing.save_checkpoint(str(root / "bert"), TrainState(iteration=1), model, None, {}, args,
                                         model.config)

    from megatrain.models.gpt import GPTModel
    from megatrain.models.gpt.config import GPTConfig

    gpt = GPTModel(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=PADDED,
                             max_position_embeddings=8))
    gpt_ckpt = checkpointing.save_checkpoint(str(root / "gpt"), TrainState(iteration=1), gpt, None, {}, args,
                                             gpt.config)
    classifier = BertClassificationModel(classification_config(_config()), num_classes=2)
    cls_ckpt = checkpointing.save_checkpoint(str(root / "cls"), TrainState(iteration=1), classifier, None,
                                             {"classification": {"num_classes": 2, "labels": ["a", "b"]}}, args,
                                             classifier.config)
    return {"root": root, "tok": tok, "bert": bert, "gpt": gpt_ckpt, "cls": cls_ckpt, "bias": bias}


def _expected(bias: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.softmax(bias[:vocab_size].double(), dim=0)


def test_literal_mask_becomes_the_mask_id(files):
    tok = files["tok"]
    assert tok.tokenize("[MASK]") != [tok.mask]  # WordPiece alone splits it into "[", "mask", "]"
    ids = fm.tokenize_with_masks(tok, "The [MASK] sat on the[MASK]")
    v = tok.vocab
    assert ids == [v["the"], tok.mask, v["sat"], v["on"], v["the"], tok.mask]
    assert fm.tokenize_with_masks(tok, "[MASK][MASK]") == [tok.mask, tok.mask]


def test_known_answer_and_probabilities(files, capsys):
    fm.main(["--load", str(files["root"] / "bert"), "--text", "the [MASK] sat on the [MASK]", "--text", "[MASK]",
             "--top-k", "3", "--json", "--device", "cpu"])
    lines = capsys.readouterr().out.strip().splitlines()
    results = [json.loads(line) for line in lines]
    assert len(results) == 2
    tok = files["tok"]
    expected = _expected(files["bias"], tok.vocab_size)
    first = results[0]
    v = tok.vocab
    assert first["tokens"] == [tok.cls, v["the"], tok.mask, v["sat"], v["on"], v["the"], tok.mask, tok.sep]
    assert [m["position"] for m in first["masks"]] == [2, 6]
    for m in first["masks"] + results[1]["masks"]:
        assert [p["token"] for p in m["predictions"]] == ["cat", "dog", "mat"]
        for p in m["predictions"]:
            assert p["id"] == v[p["token"]] and p["id"] < tok.vocab_size
            assert p["probability"] == pytest.approx(float(expected[p["id"]]), rel=1e-5)
    assert first["filled"] == "the cat sat on the cat"
    others = tok.vocab_size - 3  # every other real token's bias is 0
    assert expected[v["cat"]] == pytest.approx(math.exp(6) / (math.exp(6) + math.exp(5) + math.exp(4) + others))


def test_text_output_and_input_files(files, capsys, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("the [MASK] sat\n\n[MASK] on the mat\n")
    jsonl = tmp_path / "texts.jsonl"
    jsonl.write_text(json.dumps({"text": "a [MASK]"}) + "\n" + json.dumps("the [MASK]") + "\n")
    fm.main(["--load", str(files["root"] / "bert"), "--input-file", str(texts), "--top-k", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.count("--- text:") == 2 and "[MASK] 1: cat 0." in out and "filled: the cat sat" in out
    fm.main(["--load", str(files["root"] / "bert"), "--input-file", str(jsonl), "--json", "--device", "cpu",
             "--micro-batch-size", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["text"] for r in rows] == ["a [MASK]", "the [MASK]"] and len(rows[0]["masks"][0]["predictions"]) == 5


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        fm.main(argv)
    err = str(e.value.code) if isinstance(e.value.code, str) else capsys.readouterr().err
    assert e.value.code != 0 and "Traceback" not in err
    return err.strip()


def test_one_line_errors(files, capsys, tmp_path):
    root = files["root"]
    err = _error(capsys, ["--load", str(root / "bert"), "--text", "the cat sat"])
    assert err.startswith("error: --text 1: no [MASK]") and "\n" not in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "the [MASK]"}\n{"text": "no mask here"}\n')
    assert "bad.jsonl:2: no [MASK]" in _error(capsys, ["--load", str(root / "bert"), "--input-file", str(bad)])
    err = _error(capsys, ["--load", str(root / "gpt"), "--text", "the [MASK]"])
    assert "holds a 'gpt' model" in err and "fill-mask needs a BERT checkpoint" in err and "\n" not in err
    err = _error(capsys, ["--load", str(root / "cls"), "--text", "the [MASK]"])
    assert "classification checkpoint" in err and "\n" not in err
    assert "no checkpoint found" in _error(capsys, ["--load", str(tmp_path / "none"), "--text", "[MASK]"])
    long_text = " ".join(["the"] * 20) + " [MASK]"
    assert "more than the model's 12 positions" in _error(capsys, ["--load", str(root / "bert"), "--text", long_text])


def test_generate_on_a_bert_checkpoint_points_to_fill_mask(files):
    from megatrain.inference import text_generation

    with pytest.raises(SystemExit) as e:
        text_generation.main(["--load", str(files["root"] / "bert"), "--prompt", "the cat"])
    assert "masked language model" in str(e.value.code) and "fill_mask.py" in str(e.value.code)
