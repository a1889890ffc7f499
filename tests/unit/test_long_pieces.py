"""Huge pre-tokenized pieces: the windowed BPE gives exactly tiktoken's ids (GPT-2 BPE and
TikTokenizer), whatever the window sizes, and the tokenizers use it."""

from __future__ import annotations

import base64
import json
import random
import string
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from megatrain.data.long_pieces import LongPieceEncoder
from megatrain.data.tokenizers import GPT2_PATTERN, TIKTOKEN_PATTERN_V2, TokenizerConfig, build_tokenizer
from megatrain.data.train_tokenizer import train_tokenizer

GPT2_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gpt2"


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    """A byte-level BPE (vocab 800) trained on stdlib sources plus long letter runs."""
    root = tmp_path_factory.mktemp("bpe")
    corpus = root / "c.jsonl"
    rng = random.Random(0)
    with open(corpus, "w", encoding="utf-8") as f:
        for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:12]:
            f.write(json.dumps({"text": p.read_text(encoding="utf-8", errors="replace")}) + "\n")
        for _ in range(20):
            f.write(json.dumps({"text": "".join(rng.choices("aab", k=3000))}) + "\n")
    return train_tokenizer(str(corpus), 800, str(root / "tok"))


def gpt2_tokenizer(bpe_files):
    vocab, merges = bpe_files
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    assert tok.backend == "tiktoken"
    return tok


def mixed_texts(seed: int, n: int, sizes=(3, 40, 300, 3000, 12000)) -> list[str]:
    """Texts of long runs (random or periodic) of letters, digits, symbols, accents, CJK and
    whitespace, glued with the separators the pre-tokenizer treats specially."""
    rng = random.Random(seed)
    alphabets = [string.ascii_lowercase, "ab", "a", string.ascii_letters, "éü日本語", "0123456789",
                 "!@#$%^&*()", " ", "\n \t", "abc ", "aaaab", "the", "-=", "e\u0301", "A", "aA"]
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randrange(1, 6)):
            alpha, size = rng.choice(alphabets), rng.choice(sizes)
            if rng.random() < 0.5:
                unit = "".join(rng.choices(alpha, k=rng.randrange(1, 6)))
                parts.append((unit * (size // len(unit) + 1))[:size])
            else:
                parts.append("".join(rng.choices(alpha, k=size)))
            parts.append(rng.choice(["", " ", "  ", "\n", " \n ", ".", "'s", "x", "'", "\r\n"]))
        texts.append("".join(parts))
    return texts


@pytest.mark.parametrize("chars,window,overlap", [(20, 64, 8), (50, 200, 30), (300, 2000, 200)])
def test_windowed_bpe_gives_tiktokens_ids(bpe_files, chars, window, overlap):
    enc = gpt2_tokenizer(bpe_files)._tiktoken
    long = LongPieceEncoder(enc, GPT2_PATTERN, enc._mergeable_ranks, long_piece_chars=chars,
                            window_bytes=window, overlap_bytes=overlap)
    for text in mixed_texts(chars, 40):
        assert long.encode(text) == enc.encode_ordinary(text)
        assert long.encode_to_numpy(text).tolist() == enc.encode_ordinary(text)
    if window >= 200:
        assert long.whole_piece_fallbacks == 0  # the windows were joined, not given up on


def test_windowed_bpe_with_the_gpt2_vocabulary():
    vocab, merges = GPT2_DIR / "gpt2-vocab.json", GPT2_DIR / "gpt2-merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        pytest.skip(f"GPT-2 files not found in {GPT2_DIR}")
    enc = build_tokenizer(TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab),
                                          merge_file=str(merges)))._tiktoken
    long = LongPieceEncoder(enc, GPT2_PATTERN, enc._mergeable_ranks, long_piece_chars=50,
                            window_bytes=200, overlap_bytes=30)
    for text in mixed_texts(7, 40):
        assert long.encode(text) == enc.encode_ordinary(text)
    assert long.whole_piece_fallbacks == 0


def test_gpt2_tokenizer_on_a_long_line_equals_tiktoken(bpe_files):
    tok = gpt2_tokenizer(bpe_files)
    rng = random.Random(3)
    line = "x = " + "".join(rng.choices(string.ascii_lowercase, k=60_000)) + " and more" + " " * 20_000 + "end"
    assert tok._long.has_long_piece(line)
    ref = tok._tiktoken.encode_ordinary(line)
    assert tok.tokenize(line) == ref
    assert tok.tokenize_to_numpy(line, np.int64).tolist() == ref
    assert tok.batch_tokenize(["short", line]) == [tok._tiktoken.encode_ordinary("short"), ref]
    assert tok.detokenize(ref) == line


def test_tiktokenizer_on_a_long_line_equals_tiktoken(bpe_files, tmp_path):
    enc = gpt2_tokenizer(bpe_files)._tiktoken
    ranks = tmp_path / "r.tiktoken"
    ordered = sorted(enc._mergeable_ranks, key=enc._mergeable_ranks.get)  # renumbered 0..n-1, same order
    ranks.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ordered)))
    n = len(enc._mergeable_ranks)
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(ranks),
                                          tiktoken_pattern="v2", vocab_size=n + 16, tiktoken_num_special_tokens=16))
    for text in mixed_texts(11, 6, sizes=(5, 9000, 20000)):
        assert tok.tokenize(text) == tok._model.encode_ordinary(text)
        assert tok.tokenize_to_numpy(text).tolist() == tok._model.encode_ordinary(text)
    long = LongPieceEncoder(tok._model, TIKTOKEN_PATTERN_V2, tok._ranks, long_piece_chars=30,
                            window_bytes=128, overlap_bytes=16)
    for text in mixed_texts(12, 30):
        assert long.encode(text) == tok._model.encode_ordinary(text)
