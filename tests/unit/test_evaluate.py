"""tools/evaluate.py: loss/perplexity against a direct computation (dataset and jsonl give the same
numbers), and last-word accuracy on texts whose last word the model does or does not predict."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from megatrain.data.indexed_dataset import IndexedDatasetWriter
from megatrain.data.tokenizers import build_tokenizer
from megatrain.inference.evaluate import last_word_accuracy
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel
from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import TrainState

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = {"tokenizer_type": "NullTokenizer", "vocab_size": 30}


def tiny_model() -> GPTModel:
    model = GPTModel(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=32,
                               max_position_embeddings=16, init_method_std=0.3))
    model.init_weights(seed=2)
    return model.eval()


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "evaluate.py"), *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_loss_and_perplexity_on_dataset_and_jsonl(tmp_path):
    model = tiny_model()
    checkpointing.save_checkpoint(str(tmp_path / "ckpt"), TrainState(iteration=1), model, None, {},
                                  argparse.Namespace(**TOKENIZER, seq_length=8), model.config)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 30, size=n).tolist() for n in (5, 11, 7, 20, 3)]
    with IndexedDatasetWriter(str(tmp_path / "data"), dtype=np.uint16) as w:
        for d in docs:
            w.add_document(d + [30])
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": " ".join(map(str, d))}) + "\n" for d in docs))

    stream = np.concatenate([d + [30] for d in docs])  # 51 tokens -> 5 windows of 9
    windows = torch.tensor(np.stack([stream[i * 9:(i + 1) * 9] for i in range(len(stream) // 9)]))
    with torch.no_grad():
        expected = float(model(windows[:, :-1], labels=windows[:, 1:]).double().mean())

    results = []
    for source in (["--data-path", str(tmp_path / "data")], ["--jsonl", str(tmp_path / "docs.jsonl")]):
        out = tmp_path / "r.json"
        proc = run("--load", str(tmp_path / "ckpt"), *source, "--micro-batch-size", "2", "--device", "cpu",
                   "--output-json", str(out))
        assert proc.returncode == 0, proc.stderr
        assert "(5 windows of 8 tokens) | lm loss value:" in proc.stdout
        results.append(json.loads(out.read_text()))
    for r in results:
        assert r["windows"] == 5 and r["tokens"] == 40
        assert abs(r["lm loss"] - expected) < 1e-5 and abs(r["lm loss PPL"] - math.exp(expected)) < 1e-3

    bad = run("--load", str(tmp_path / "ckpt"), "--jsonl", str(tmp_path / "missing.jsonl"))
    assert bad.returncode == 2 and "missing.jsonl: cannot open" in bad.stderr


def test_last_word_accuracy(tmp_path):
    model = tiny_model()
    tok = build_tokenizer(TOKENIZER)
    texts = []
    with torch.no_grad():
        for ctx in ([1, 2, 3], [4, 5], [7, 8, 9, 10]):
            best = int(model(torch.tensor([ctx]))[0, -1].argmax())
            texts.append(" ".join(map(str, ctx + [best])))  # the model predicts this last word
            texts.append(" ".join(map(str, ctx + [(best + 1) % 30])))  # and not this one
    results = last_word_accuracy(model, tok, iter(texts))
    assert results == {"last-word accuracy": 0.5, "correct": 3, "texts": 6}

    checkpointing.save_checkpoint(str(tmp_path / "ckpt"), TrainState(iteration=1), model, None, {},
                                  argparse.Namespace(**TOKENIZER), model.config)
    (tmp_path / "lambada.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    proc = run("--load", str(tmp_path / "ckpt"), "--lambada", str(tmp_path / "lambada.jsonl"), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "last-word accuracy: 0.5000 (3/6)" in proc.stdout
    (tmp_path / "bad.jsonl").write_text('{"text": "1 2"}\n{"txt": "3"}\n')
    proc = run("--load", str(tmp_path / "ckpt"), "--lambada", str(tmp_path / "bad.jsonl"), "--device", "cpu")
    assert proc.returncode == 2 and "bad.jsonl:2: expected an object with a string 'text'" in proc.stderr
