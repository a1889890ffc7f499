"""Tiny T5 models, a WordPiece vocabulary with sentinels and checkpoints written as the trainer writes
them, for the T5 conversion, generation and fine-tuning tests (no downloads)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import TrainState
from megatrain.models.t5 import T5Config, T5Model
from megatrain.training.builders import padded_vocab_size

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "big", "red", "hello", "world", ".", ","]
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
VOCAB_LINES = SPECIAL + WORDS + LETTERS + ["##" + c for c in LETTERS]
EXTRA_IDS = 4  # --vocab-extra-ids: <extra_id_0..3> appended by megatrain's WordPiece
V = len(VOCAB_LINES) + EXTRA_IDS  # the tokenizer's size
PADDED = padded_vocab_size(V, 128)  # the embedding's rows (the padding must never reach Hugging Face)
CLS, SEP, PAD = 2, 3, 0

# kv_channels 16 and hidden 64: sqrt(16) and sqrt(64) are powers of two, so the folds are exact
BASE = dict(num_layers=2, decoder_num_layers=3, hidden_size=64, num_attention_heads=4, kv_channels=16,
            ffn_hidden_size=96, vocab_size=PADDED, max_position_embeddings=64, hidden_dropout=0.0,
            attention_dropout=0.0, position_embedding_type="relative", normalization="RMSNorm", norm_epsilon=1e-6,
            add_bias_linear=False, relative_attention_num_buckets=8, relative_attention_max_distance=20)
STYLES = {
    "tied_gelu": dict(swiglu=False),
    "tied_swiglu": dict(swiglu=True),
    "untied_gelu_tanh": dict(swiglu=False, gelu_approximation="tanh", untie_embeddings_and_output_weights=True),
    "untied_swiglu": dict(swiglu=True, untie_embeddings_and_output_weights=True),
}


def write_vocab(path: Path) -> Path:
    path.write_text("".join(t + "\n" for t in VOCAB_LINES), encoding="utf-8")
    return path


def config(style: str = "tied_swiglu", **overrides) -> T5Config:
    return T5Config(**{**BASE, **STYLES[style], **overrides})


def random_model(style: str = "tied_swiglu", seed: int = 0, **overrides) -> T5Model:
    """Every parameter random (norms, relative-position tables, padding rows) except the tied output
    bias, which Hugging Face cannot hold unless it is zero."""
    torch.manual_seed(seed)
    model = T5Model(config(style, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "output_layer.bias":
                p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def run_args(vocab: Path, cfg: T5Config, **extra) -> argparse.Namespace:
    """The run arguments a pretrain_t5.py checkpoint records (model, lengths, tokenizer)."""
    return argparse.Namespace(
        tokenizer_type="BertWordPieceLowerCase", vocab_file=str(vocab), vocab_extra_ids=EXTRA_IDS,
        num_layers=cfg.num_layers, encoder_num_layers=cfg.num_layers, decoder_num_layers=cfg.decoder_layers,
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, kv_channels=cfg.kv_channels,
        ffn_hidden_size=cfg.ffn_hidden_size, max_position_embeddings=cfg.max_position_embeddings,
        position_embedding_type=cfg.position_embedding_type, normalization=cfg.normalization,
        norm_epsilon=cfg.norm_epsilon, add_bias_linear=cfg.add_bias_linear, swiglu=cfg.swiglu,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        relative_attention_num_buckets=cfg.relative_attention_num_buckets,
        relative_attention_max_distance=cfg.relative_attention_max_distance, seq_length=32, encoder_seq_length=32,
        decoder_seq_length=16, make_vocab_size_divisible_by=128, **extra)


def save(model: T5Model, path: Path, vocab: Path) -> Path:
    """A checkpoint as the trainer writes one: the model, its config and the run's arguments."""
    checkpointing.save_checkpoint(str(path), TrainState(iteration=3), model, None, {}, run_args(vocab, model.config),
                                  model.config)
    return path
