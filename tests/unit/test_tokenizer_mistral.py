"""``--tokenizer-type MistralTokenizer`` (Megatron's, a mistral-common wrapper): a local Hugging Face
tokenizer folder is read as megatrain's ``HuggingFaceTokenizer`` with a note; a mistral-common file
(``tekken.json``), a Hub name or a folder without the Hugging Face files is one line asking for the
model's Hugging Face folder. Offline: the folder is written with ``tokenizers``."""

from __future__ import annotations

import argparse

import pytest

from megatrain.data.tokenizers import TokenizerConfig, build_tokenizer
from megatrain.data.tokenizers.huggingface import HuggingFaceTokenizer
from megatrain.data.tokenizers.registry import TOKENIZER_TYPES, add_tokenizer_args
from tests.unit.test_tokenizer_registry import _hf_files


def test_a_hugging_face_folder_is_the_hugging_face_tokenizer(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    files = _hf_files(tmp_path)
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="MistralTokenizer", **files))
    assert isinstance(tok, HuggingFaceTokenizer) and tok.name == "MistralTokenizer"
    reference = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", **files))
    assert tok.tokenize("hello world") == reference.tokenize("hello world") == [3, 4]
    assert tok.vocab_size == reference.vocab_size and tok.eod == reference.eod
    assert capsys.readouterr().out.strip() == (f"note: --tokenizer-type MistralTokenizer: read as HuggingFaceTokenizer "
                                               f"of {tmp_path} (megatrain does not wrap mistral-common)")


def test_a_tokenizer_config_alone_is_a_hugging_face_folder_too(tmp_path):
    _hf_files(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="MistralTokenizer", tokenizer_model=str(tmp_path)))
    assert tok.tokenize("hello") == [3]


@pytest.mark.parametrize("case,found", [
    ("tekken", "tekken.json is a file (mistral-common's, e.g. tekken.json)"),
    ("hub", "no such folder (a Hub name is not downloaded)"),
    ("empty", "the folder has no tokenizer.json or tokenizer_config.json"),
    ("none", "no --tokenizer-model"),
])
def test_anything_else_is_one_line_asking_for_the_folder(tmp_path, case, found):
    model = {"tekken": tmp_path / "tekken.json", "hub": "mistralai/Mistral-7B-Instruct-v0.3", "empty": tmp_path,
             "none": None}[case]
    if case == "tekken":
        model.write_text("{}")
    with pytest.raises(ValueError) as err:
        build_tokenizer(TokenizerConfig(tokenizer_type="MistralTokenizer",
                                        tokenizer_model=None if model is None else str(model)))
    assert str(err.value) == (f"--tokenizer-type MistralTokenizer --tokenizer-model {model}: {found}; megatrain "
                              "does not wrap mistral-common: pass the model's Hugging Face tokenizer folder "
                              "(tokenizer.json, tokenizer_config.json)")


def test_every_script_offers_it():
    assert "MistralTokenizer" in TOKENIZER_TYPES
    parser = add_tokenizer_args(argparse.ArgumentParser())
    assert parser.parse_args(["--tokenizer-type", "MistralTokenizer"]).tokenizer_type == "MistralTokenizer"
