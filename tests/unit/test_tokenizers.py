"""Tokenizer types behind --tokenizer-type: ids, special tokens, errors, tiktoken == HF."""

from __future__ import annotations

import argparse
import base64
import glob
import json
import sysconfig
from pathlib import Path

import pytest

from megatrain.data.tokenizers import (
    GPT2BPETokenizer,
    TokenizerConfig,
    add_tokenizer_args,
    build_tokenizer,
    bytes_to_unicode,
)

GPT2_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gpt2"
GPT2_VOCAB = GPT2_DIR / "gpt2-vocab.json"
GPT2_MERGES = GPT2_DIR / "gpt2-merges.txt"

EDGE_CASES = [
    "",
    " ",
    "Hello world",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\nand  double  spaces",
    "I'm sure they'll've DONE it's 'quoted' O'Neil",
    "numbers 1234567890 3.14159 -42 1e10",
    "unicode: naïve café Ωμέγα 日本語テキスト 한국어 🙂👍🏽 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "zero\u200bwidth\u00a0nbsp\u3000ideographic space",
    "<|endoftext|> stays text",
    "def f(x):\n    return x ** 2  # comment\n\n\n",
    "a" * 3000,
    " " * 500 + "x",
    "\U0010ffff\ufffd",
]


def need_gpt2():
    if not (GPT2_VOCAB.is_file() and GPT2_MERGES.is_file()):
        pytest.skip(f"GPT-2 files not found in {GPT2_DIR}")


@pytest.fixture(scope="module")
def gpt2_pair():
    need_gpt2()
    fast = GPT2BPETokenizer(str(GPT2_VOCAB), str(GPT2_MERGES), backend="auto")
    hf = GPT2BPETokenizer(str(GPT2_VOCAB), str(GPT2_MERGES), backend="hf")
    return fast, hf


def stdlib_text(limit_bytes: int) -> list[str]:
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True))
    out, total = [], 0
    for f in files:
        text = Path(f).read_text(encoding="utf-8", errors="replace")
        out.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return out


def test_gpt2_known_ids(gpt2_pair):
    fast, hf = gpt2_pair
    assert fast.backend == "tiktoken" and hf.backend == "hf"
    assert fast.vocab_size == 50257 and fast.eod == 50256
    for tok in (fast, hf):
        assert tok.tokenize("Hello world") == [15496, 995]
        assert tok.tokenize(" Hello") == [18435]
        assert tok.tokenize("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]
        assert tok.detokenize([15496, 995, 50256]) == "Hello world<|endoftext|>"


def test_gpt2_matches_independent_hf_byte_level_bpe(gpt2_pair):
    """Ids from a ByteLevel BPE built directly by the tokenizers library from the same files."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    ref = Tokenizer(models.BPE.from_file(str(GPT2_VOCAB), str(GPT2_MERGES)))
    ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast, _ = gpt2_pair
    for text in EDGE_CASES:
        assert fast.tokenize(text) == ref.encode(text, add_special_tokens=False).ids, text


def test_gpt2_tiktoken_equals_hf_on_real_text(gpt2_pair):
    fast, hf = gpt2_pair
    texts = stdlib_text(300_000) + EDGE_CASES
    fast_ids = fast.batch_tokenize(texts)
    assert fast_ids == [hf.tokenize(t) for t in texts]
    assert sum(map(len, fast_ids)) > 50_000
    for t in texts[:20] + EDGE_CASES:
        assert fast.detokenize(fast.tokenize(t)) == t
        assert fast.tokenize_to_numpy(t).tolist() == hf.tokenize(t)


def test_tiktoken_backend_rejects_non_rank_vocab(tmp_path):
    """When ids are not merge ranks the auto backend falls back to HF, and stays exact."""
    byte_tokens = list(bytes_to_unicode().values())
    merges = [("a", "b"), ("ab", "c")]
    vocab = {"<|endoftext|>": 0, "abc": 1}  # 'abc' made by the 2nd merge gets a lower id than 'ab'
    for t in byte_tokens:
        vocab.setdefault(t, len(vocab))
    vocab["ab"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    tok = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    assert tok.backend == "hf"
    assert tok.tokenize("abc ab") == [vocab["abc"], vocab["Ġ"], vocab["ab"]]
    with pytest.raises(ValueError, match="tiktoken cannot reproduce"):
        GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), backend="tiktoken")


def test_gpt2_missing_and_malformed_files(tmp_path):
    need_gpt2()
    base = dict(tokenizer_type="GPT2BPETokenizer", vocab_file=str(GPT2_VOCAB), merge_file=str(GPT2_MERGES))
    with pytest.raises(ValueError, match="--vocab-file .*nope.json: no such file"):
        build_tokenizer({**base, "vocab_file": str(tmp_path / "nope.json")})
    with pytest.raises(ValueError, match="needs --merge-file"):
        build_tokenizer({**base, "merge_file": None})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=f"--vocab-file {bad}"):
        build_tokenizer({**base, "vocab_file": str(bad)})
    bad_merges = tmp_path / "bad.txt"
    bad_merges.write_text("#version: 0.2\nĠ t\nthree parts here\n")
    with pytest.raises(ValueError, match=f"--merge-file {bad_merges} line 3"):
        build_tokenizer({**base, "merge_file": str(bad_merges)})


def test_add_tokenizer_args_megatron_names():
    parser = add_tokenizer_args(argparse.ArgumentParser())
    ns = parser.parse_args(
        ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--vocab-file", "v", "--merge-file", "m",
         "--tokenizer-model", "t"]
    )
    assert (ns.tokenizer_type, ns.vocab_size, ns.vocab_file, ns.merge_file, ns.tokenizer_model) == (
        "NullTokenizer", 100, "v", "m", "t")
    assert ns.vocab_extra_ids == 0 and ns.tiktoken_num_special_tokens == 1000
    cfg = TokenizerConfig.from_namespace(ns)
    assert cfg.tokenizer_type == "NullTokenizer" and cfg.bpe_backend == "auto"
    assert build_tokenizer(ns).vocab_size == 101


def test_unknown_or_missing_type():
    with pytest.raises(ValueError, match="--tokenizer-type is required"):
        build_tokenizer(TokenizerConfig())
    with pytest.raises(ValueError, match="not supported"):
        build_tokenizer(TokenizerConfig(tokenizer_type="Nope"))


def test_null_tokenizer_follows_megatron():
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=1000))
    assert tok.vocab_size == 1001 and tok.eod == 1000
    assert tok.tokenize("5 17 999") == [5, 17, 999]
    assert tok.detokenize([5, 17]) == "5 17"
    assert tok.batch_tokenize(["1 2", "3"]) == [[1, 2], [3]]
    with pytest.raises(ValueError, match="integer ids"):
        tok.tokenize("5 x")
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("1001")
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer"))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(stdlib_text(60_000)[:40]), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(d / "m"), vocab_size=300, model_type="bpe",
        pad_id=3, minloglevel=2, num_threads=1,
    )
    return str(d / "m.model")


def test_sentencepiece_megatron_specials(sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=sp_model)
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model,
                                          vocab_extra_ids=2))
    # <CLS> <SEP> <EOD> <MASK> appended, then <extra_id_0/1>; pad/bos/eos are the model's own.
    assert tok.vocab_size == 300 + 4 + 2
    assert tok.eod == 302 and tok.pad == 3 and tok.bos == sp.bos_id() and tok.eos == sp.eos_id()
    assert tok.vocab["<extra_id_1>"] == 305
    text = "def foo(): return 1"
    assert tok.tokenize(text) == sp.encode_as_ids(text)
    assert tok.tokenize("a<EOD>b") == sp.encode_as_ids("a") + [302] + sp.encode_as_ids("b")
    assert tok.detokenize(tok.tokenize(text)) == text

    gpt = build_tokenizer(TokenizerConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sp_model))
    assert gpt.vocab_size == 300 and gpt.eod == sp.eos_id() and gpt.tokenize(text) == sp.encode_as_ids(text)
    llama = build_tokenizer(TokenizerConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=sp_model))
    assert llama.tokenize(text) == [sp.bos_id()] + sp.encode_as_ids(text)


def test_sentencepiece_bad_model(tmp_path):
    bad = tmp_path / "x.model"
    bad.write_bytes(b"garbage")
    with pytest.raises(ValueError, match=f"--tokenizer-model {bad}"):
        build_tokenizer(TokenizerConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(bad)))


def test_huggingface_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(stdlib_text(50_000), trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<pad>"], show_progress=False))
    folder = tmp_path / "hf"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    for path in (folder, folder / "tokenizer.json"):
        t = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(path)))
        assert t.vocab_size == tok.get_vocab_size()
        assert (t.eod, t.bos, t.pad) == (2, 1, 3)
        assert t.tokenize("import os") == tok.encode("import os").ids
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    assert build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                           tokenizer_model=str(folder))).eod == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(empty)))


def test_tiktokenizer_from_ranks_file(tmp_path):
    need_gpt2()
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    vocab = json.loads(GPT2_VOCAB.read_text(encoding="utf-8"))
    lines = [
        base64.b64encode(bytes(decoder[c] for c in t)).decode() + f" {i}"
        for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if t != "<|endoftext|>"
    ]
    ranks = tmp_path / "gpt2.tiktoken"
    ranks.write_text("\n".join(lines) + "\n")
    cfg = TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(ranks), tiktoken_pattern="v1",
                          vocab_size=50256 + 16, tiktoken_num_special_tokens=16)
    tok = build_tokenizer(cfg)
    assert tok.vocab_size == 50272 and tok.eod == 2 and tok.bos == 1
    ids = tok.tokenize("Hello world")
    assert [i - 16 for i in ids] == [15496, 995]
    text = "naïve café 🙂 def f(x):\n  return 1"
    assert tok.detokenize(tok.tokenize(text)) == text
    assert min(tok.tokenize(text)) >= 16
    # Megatron's JSON ranks format gives the same tokenizer.
    js = tmp_path / "ranks.json"
    js.write_text(json.dumps([
        {"rank": int(l.split()[1]), "token_bytes": l.split()[0], "token_str": ""} for l in lines]))
    assert build_tokenizer(TokenizerConfig(**{**cfg.__dict__, "tokenizer_model": str(js)})).tokenize(text) == \
        tok.tokenize(text)
    with pytest.raises(ValueError, match="--tiktoken-pattern"):
        build_tokenizer(TokenizerConfig(**{**cfg.__dict__, "tiktoken_pattern": None}))
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("AAA= 5\n")
    with pytest.raises(ValueError, match=f"--tokenizer-model {bad}"):
        build_tokenizer(TokenizerConfig(**{**cfg.__dict__, "tokenizer_model": str(bad)}))


def test_bert_wordpiece(tmp_path):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "##s", "un", "##able", "!",
             "Hello", "cafe"]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(vocab) + "\n")
    low = build_tokenizer(TokenizerConfig(tokenizer_type="BertWordPieceLowerCase", vocab_file=str(path)))
    assert low.tokenize("Hello worlds unable! Café") == [5, 6, 7, 8, 9, 10, 12]
    # Megatron-LM's conventions: the file's vocabulary; [CLS] begins and [SEP] ends (eos = eod)
    assert low.vocab_size == len(vocab) and low.eod == low.eos == low.sep == 3 and low.bos == low.cls == 2
    assert low.pad == 0
    assert low.detokenize([5, 6, 7]) == "hello worlds"
    case = build_tokenizer(TokenizerConfig(tokenizer_type="BertWordPieceCase", vocab_file=str(path),
                                           vocab_extra_ids=3))
    assert case.tokenize("Hello hello HELLO") == [11, 5, 1]
    assert case.vocab_size == len(vocab) + 3 and case.inv_vocab[len(vocab)] == "<extra_id_0>"
    bad = tmp_path / "bad.txt"
    bad.write_text("a\nb\n")
    with pytest.raises(ValueError, match=r"--vocab-file .*bad.txt.*\[UNK\]"):
        build_tokenizer(TokenizerConfig(tokenizer_type="BertWordPieceCase", vocab_file=str(bad)))


def test_train_tokenizer_files_load_and_round_trip(tmp_path):
    from megatrain.data.train_tokenizer import main as train_main

    texts = stdlib_text(120_000)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    vocab_path, merges_path = train_main(
        ["--input", str(corpus), "--vocab-size", "600", "--output-dir", str(tmp_path / "tok")])
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_path,
                                          merge_file=merges_path))
    hf = GPT2BPETokenizer(vocab_path, merges_path, backend="hf")
    assert tok.backend == "tiktoken" and tok.vocab_size == 600
    assert tok.eod == tok.vocab["<|endoftext|>"]
    for text in texts[:5] + EDGE_CASES:
        ids = tok.tokenize(text)
        assert ids == hf.tokenize(text)
        assert tok.detokenize(ids) == text
    assert len(tok.tokenize(texts[0])) < 0.7 * len(texts[0].encode())  # it learned merges
    with pytest.raises(SystemExit, match="--vocab-size must be larger"):
        train_main(["--input", str(corpus), "--vocab-size", "100", "--output-dir", str(tmp_path / "t2")])
