"""Fine-tuning data: response-only loss targets, chat template, packing with per-example attention and
positions, deterministic epochs, and bad jsonl lines named with file and line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from megatrain.data.sft_dataset import (SFTConfig, SFTDataset, build_sft_datasets, sft_batch, tokenize_example)
from megatrain.data.tokenizers import build_tokenizer
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel

REPO = Path(__file__).resolve().parents[2]
GPT2_FILES = REPO / ".." / "shared" / "data" / "gpt2"
NULL = build_tokenizer({"tokenizer_type": "NullTokenizer", "vocab_size": 20})  # eod = pad = 20


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_prompt_tokens_carry_no_loss():
    ex = tokenize_example({"prompt": "1 2 3", "response": "7 8"}, NULL, SFTConfig(seq_length=16))
    assert ex.tokens == [1, 2, 3, 7, 8, 20]
    assert ex.targets == [False, False, False, True, True, True]
    ds = SFTDataset([ex], seq_length=8, num_samples=1, seed=0, pad_id=20)
    batch = sft_batch(default_collate([ds[0]]))
    assert batch.tokens.tolist() == [[1, 2, 3, 7, 8, 20, 20, 20]]
    assert batch.labels.tolist() == [[2, 3, 7, 8, 20, 20, 20, 20]]
    # Loss only where the label is a response token or the closing EOD.
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 1, 0, 0, 0]]
    assert batch.attention_mask is None

    # The masked loss does not depend on the prompt's labels at all.
    model = GPTModel(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=24,
                               max_position_embeddings=16)).eval()
    def masked_loss(labels):
        per_token = model(batch.tokens, labels=labels)
        return (per_token * batch.loss_mask).sum()
    changed = batch.labels.clone()
    changed[0, :2] = 5
    assert torch.equal(masked_loss(batch.labels), masked_loss(changed))


def test_chat_template_targets_only_assistant_content():
    if not (GPT2_FILES / "gpt2-vocab.json").exists():
        pytest.skip("../shared/data/gpt2 is not available")
    tok = build_tokenizer({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": str(GPT2_FILES / "gpt2-vocab.json"),
                           "merge_file": str(GPT2_FILES / "gpt2-merges.txt")})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Bye now"}]
    ex = tokenize_example({"messages": messages}, tok, SFTConfig(seq_length=64))
    assert tok.detokenize(ex.tokens) == ("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello\n"
                                         "<|user|>\nBye\n<|assistant|>\nBye now\n<|endoftext|>")
    trained = tok.detokenize([t for t, on in zip(ex.tokens, ex.targets) if on])
    assert trained == "Hello\nBye now\n<|endoftext|>"


def test_packing_keeps_examples_apart():
    examples = [tokenize_example({"prompt": p, "response": r}, NULL, SFTConfig(seq_length=16))
                for p, r in (("1 2", "3"), ("4", "5 6"), ("7 8 9", "10"))]  # 4, 4 and 5 tokens
    ds = SFTDataset(examples, seq_length=9, num_samples=2, seed=0, pad_id=20, pack=True)
    assert ds.bins == [[0, 1], [2]]
    sample = ds[int(np.flatnonzero([len(ds.bins[i]) == 2 for i in ds._order(0)])[0])]
    batch = sft_batch(default_collate([sample]))
    assert batch.tokens.tolist() == [[1, 2, 3, 20, 4, 5, 6, 20, 20]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0]]
    # The first token of the second example is not predicted from the first example's EOD.
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 1, 1, 1, 0, 0]]
    mask = batch.attention_mask[0, 0]
    assert not mask[4, :4].any() and mask[4, 4] and mask[7, 4:8].all() and not mask[3, 4:].any()


def test_epochs_reshuffle_deterministically_and_split(tmp_path):
    rows = [{"prompt": str(i), "response": str(i + 1)} for i in range(10)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    train, valid, test = build_sft_datasets([path], "80,20,0", NULL, SFTConfig(seq_length=4), [20, 4, 0], seed=3)
    assert test is None and len(train.examples) == 8 and len(valid.examples) == 2
    firsts = [int(train[i]["tokens"][0]) for i in range(16)]
    assert sorted(firsts[:8]) == sorted(firsts[8:]) == list(range(8)) and firsts[:8] != firsts[8:]
    again, _, _ = build_sft_datasets([path], "80,20,0", NULL, SFTConfig(seq_length=4), [20, 4, 0], seed=3)
    assert all(np.array_equal(train[i][k], again[i][k]) for i in range(20) for k in train[i])


@pytest.mark.parametrize("line, message", [
    ("{not json", r"d.jsonl:2: not valid JSON"),
    ('["a"]', r"d.jsonl:2: expected a JSON object"),
    ('{"prompt": "1"}', r"d.jsonl:2: expected string keys 'prompt' and 'response'"),
    ('{"prompt": "1", "response": ""}', r"d.jsonl:2: empty 'response'"),
    ('{"messages": [{"role": "user", "content": "1"}]}', r"d.jsonl:2: no assistant message"),
    ('{"messages": [{"role": "robot", "content": "1"}]}', r"d.jsonl:2: message 0 must be"),
    ('{"prompt": "1 x", "response": "2"}', r"d.jsonl:2: NullTokenizer expects"),
])
def test_bad_lines_are_named(tmp_path, line, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1", "response": "2"}, line])
    with pytest.raises(ValueError, match=message):
        build_sft_datasets([path], "100,0,0", NULL, SFTConfig(seq_length=8), [4, 0, 0], seed=0)
