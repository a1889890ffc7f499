"""The --tokenizer-type registry: every choice a parser offers has a builder, and every type builds
(from small files this test writes; nothing is downloaded)."""

from __future__ import annotations

import argparse
import base64
import json

import pytest

from megatrain.data.tokenizers import (
    TOKENIZER_BUILDERS,
    TOKENIZER_TYPES,
    MegatrainTokenizer,
    TokenizerConfig,
    build_tokenizer,
    bytes_to_unicode,
)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from megatrain.data.preprocess import build_parser as preprocess_parser
    from megatrain.inference.evaluate import build_parser as evaluate_parser
    from megatrain.inference.serve import build_parser as serve_parser
    from megatrain.inference.text_generation import build_parser as generate_parser
    from megatrain.training.arguments import build_parser as train_parser

    return {"pretrain": train_parser(), "preprocess": preprocess_parser(), "evaluate": evaluate_parser(),
            "generate": generate_parser(), "serve": serve_parser()}


def _choices(parser: argparse.ArgumentParser) -> list[str]:
    (action,) = [a for a in parser._actions if "--tokenizer-type" in a.option_strings]
    return list(action.choices)


@pytest.mark.parametrize("name", ["pretrain", "preprocess", "evaluate", "generate", "serve"])
def test_every_parser_choice_has_a_builder(name):
    choices = _choices(_parsers()[name])
    assert choices == list(TOKENIZER_TYPES) == list(TOKENIZER_BUILDERS)
    assert len(set(choices)) == len(choices) == 11


def test_parser_rejects_a_type_outside_the_registry(capsys):
    parser = _parsers()["preprocess"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--input", "x.jsonl", "--output-prefix", "o", "--tokenizer-type", "Nope"])
    err = capsys.readouterr().err
    assert "--tokenizer-type" in err and all(t in err for t in TOKENIZER_TYPES)


def test_unknown_type_is_one_line_naming_every_known_type():
    with pytest.raises(ValueError) as e:
        build_tokenizer({"tokenizer_type": "GPT3BPETokenizer"})
    msg = str(e.value)
    assert "\n" not in msg and "'GPT3BPETokenizer' is not supported" in msg
    assert all(t in msg for t in TOKENIZER_TYPES)


# ---- small tokenizer files, one writer per type -------------------------------------------------
def _gpt2_files(d):
    """Byte tokens (ids 0..255), merges he, ll, hell (256..258), then <|endoftext|>: ids are merge
    ranks, so the tiktoken engine is used."""
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    merges = [("h", "e"), ("l", "l"), ("he", "ll")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (d / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (d / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return {"vocab_file": str(d / "vocab.json"), "merge_file": str(d / "merges.txt")}


def _hf_files(d):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    return {"tokenizer_model": str(d)}


def _sp_files(d):
    import sentencepiece as spm

    (d / "corpus.txt").write_text("hello world\nthe quick brown fox jumps over the lazy dog\n" * 20)
    spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "m"), vocab_size=40,
                                   model_type="char", hard_vocab_limit=False, minloglevel=2, num_threads=1)
    return {"tokenizer_model": str(d / "m.model")}


def _tiktoken_files(d):
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll"]
    (d / "r.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return {"tokenizer_model": str(d / "r.tiktoken"), "tiktoken_pattern": "v2", "vocab_size": 258 + 4,
            "tiktoken_num_special_tokens": 4}


def _wordpiece_files(d):
    (d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"]) + "\n")
    return {"vocab_file": str(d / "vocab.txt")}


FILES = {
    "BertWordPieceLowerCase": _wordpiece_files,
    "BertWordPieceCase": _wordpiece_files,
    "GPT2BPETokenizer": _gpt2_files,
    "SentencePieceTokenizer": _sp_files,
    "GPTSentencePieceTokenizer": _sp_files,
    "Llama2Tokenizer": _sp_files,
    "HuggingFaceTokenizer": _hf_files,
    "TikTokenizer": _tiktoken_files,
    "NullTokenizer": lambda d: {"vocab_size": 50},  # needs no file
    # a tokenizer.json with a prompt format whose pad token (<unk>) it has
    "SFTTokenizer": lambda d: {**_hf_files(d), "sft_tokenizer_prompt_format": "identity"},
    "MistralTokenizer": _hf_files,  # Megatron's (mistral-common): a Hugging Face folder here
}


def test_every_registered_type_has_a_build_case_here():
    assert set(FILES) == set(TOKENIZER_BUILDERS)


@pytest.mark.parametrize("kind", TOKENIZER_TYPES)
def test_every_type_builds_and_round_trips(kind, tmp_path):
    cfg = TokenizerConfig(tokenizer_type=kind, **FILES[kind](tmp_path))
    tok = build_tokenizer(cfg)
    assert isinstance(tok, MegatrainTokenizer) and tok.name == kind
    text = "3 4 7" if kind == "NullTokenizer" else "hello world"
    ids = tok.tokenize(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.batch_tokenize([text, text]) == [ids, ids]
    assert tok.tokenize_to_numpy(text).tolist() == ids
    assert isinstance(tok.eod, int) and 0 <= tok.eod < tok.vocab_size
    assert tok.detokenize(ids) == text
    # the same through an argparse namespace and a dict, as the command-line tools pass it
    assert build_tokenizer(argparse.Namespace(**vars(cfg))).tokenize(text) == ids
    assert build_tokenizer(vars(cfg)).tokenize(text) == ids


def test_small_gpt2_files_run_on_tiktoken_and_merge(tmp_path):
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="GPT2BPETokenizer", **_gpt2_files(tmp_path)))
    assert tok.backend == "tiktoken"
    assert tok.tokenize("hello") == [tok.vocab["hell"], tok.vocab["o"]]
    assert tok.eod == tok.vocab_size - 1 == 259


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
                                  "TikTokenizer", "BertWordPieceCase"])
def test_a_type_without_its_file_flag_names_the_flag(kind):
    with pytest.raises(ValueError, match=f"{kind} needs --"):
        build_tokenizer(TokenizerConfig(tokenizer_type=kind, tiktoken_pattern="v1"))
