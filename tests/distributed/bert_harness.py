"""Tiny BERT runs of the real trainer for the layout tests: ``pretrain_bert.py``'s command line
(:func:`megatrain.training.main.parse_family_args`), a tiny WordPiece vocabulary, and synthetic
masked-LM samples in the BERT dataset's format (Megatron's field names) fed through the trainer's
``build_datasets`` hook, the same samples for every layout.

Each sample has padding (so the padding mask matters), two segments (token types 0/1), about a
sixth of its real tokens masked (loss mask and labels) and a sentence-order label.
"""

from __future__ import annotations

import os
import shlex
import tempfile
from typing import Any

import numpy as np
import torch

from dist_harness import CLIP, SEED, Run, full_parameters, run_alone_then_workers
from megatrain.training.trainer import Trainer

SEQ, MICRO, GLOBAL, STEPS = 16, 2, 8, 4
MASK_PROB = 0.5  # at most int(0.5 x (SEQ - 3)) + 1 = 7 masked positions per sample
MAX_PREDICTIONS = int(MASK_PROB * (SEQ - 3)) + 1
WORDS = [f"w{i}" for i in range(40)] + [f"##p{i}" for i in range(10)]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def vocab_file() -> str:
    path = os.path.join(tempfile.gettempdir(), f"megatrain-bert-harness-{os.getpid()}-vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(SPECIAL + WORDS) + "\n")
    return path


def sample(index: int) -> dict[str, Any]:
    """A synthetic BERT sample (the fields of Megatron's BERTMaskedWordPieceDataset)."""
    g = np.random.RandomState(5000 + index)
    length = int(g.randint(SEQ // 2, SEQ + 1))
    split = int(g.randint(2, length - 1))
    text = g.randint(len(SPECIAL), len(SPECIAL) + len(WORDS), size=SEQ).astype(np.int64)
    text[0], text[split - 1], text[length - 1] = 2, 3, 3
    types = np.zeros(SEQ, np.int64)
    types[split:length] = 1
    loss_mask = np.zeros(SEQ, np.int64)  # 1 to MAX_PREDICTIONS masked positions, as --mask-prob allows
    count = min(int(g.randint(1, MAX_PREDICTIONS + 1)), length - 2)
    loss_mask[g.choice(np.arange(1, length - 1), count, replace=False)] = 1
    labels = np.where(loss_mask == 1, text, -1)
    text = np.where((loss_mask == 1) & (g.rand(SEQ) < 0.8), 4, text)
    padding = (np.arange(SEQ) < length).astype(np.int64)
    text[length:] = 0
    return {"text": text, "types": types, "labels": labels, "is_random": int(g.randint(0, 2)),
            "padding_mask": padding, "loss_mask": loss_mask, "truncated": 0}


class Samples:
    def __init__(self, size: int, offset: int = 0) -> None:
        self.size, self.offset = size, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:
        return sample(self.offset + i)


class BertHarnessTrainer(Trainer):
    def build_datasets(self, num_samples: list[int]) -> tuple[Any, Any, Any]:
        return Samples(num_samples[0]), Samples(GLOBAL, 100_000), None


def bert_flags(layout: str = "", *, num_layers: int = 2, steps: int = STEPS, binary_head: bool = True,
               model: str = "") -> list[str]:
    """``pretrain_bert.py``'s flags of the tiny run; ``model``: more model flags (a layout's reference
    gets them too), ``layout``: the parallel layout's flags."""
    flags = ["--num-layers", str(num_layers), "--hidden-size", "32", "--num-attention-heads", "4",
             "--ffn-hidden-size", "64", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
             "--hidden-dropout", "0", "--attention-dropout", "0", "--no-bias-gelu-fusion", "--mask-prob", str(MASK_PROB),
             "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL), "--train-iters", str(steps),
             "--lr", "1e-2", "--lr-decay-style", "constant", "--weight-decay", "0.1", "--adam-eps", "1e-4",
             "--clip-grad", str(CLIP), "--seed", str(SEED), "--tokenizer-type", "BertWordPieceLowerCase",
             "--vocab-file", vocab_file(), "--make-vocab-size-divisible-by", "32",
             "--data-path", "unused-the-harness-feeds-samples", "--num-workers", "0", "--eval-iters", "1",
             "--device", "cpu"]
    if not binary_head:
        flags.append("--bert-no-binary-head")
    return flags + shlex.split(model) + shlex.split(layout)


def train_bert(layout: str = "", *, num_layers: int = 2, steps: int = STEPS, binary_head: bool = True,
               model: str = "", evaluate: bool = True) -> Run:
    from megatrain.training.main import parse_family_args

    args = parse_family_args("bert", bert_flags(layout, num_layers=num_layers, steps=steps, binary_head=binary_head,
                                                   model=model))
    trainer = BertHarnessTrainer(args, family="bert")
    try:
        results = [trainer.train_step() for _ in range(steps)]
        names = trainer.objective.loss_names
        losses = [float(r.loss) for r in results]
        info = {"names": names, "per_loss": [dict(r.losses) for r in results]}
        eval_loss = trainer.evaluate(trainer.valid_iter, 1) if evaluate else None
        return Run(losses, [r.grad_norm for r in results], full_parameters(trainer.module), info, eval_loss)
    finally:
        trainer.close()


# A layout: (flags, keyword arguments of train_bert)
Layout = tuple[str, dict[str, Any]]


def _train_layouts(rank: int, world_size: int, layouts: dict[str, Layout]) -> dict[str, Run]:
    torch.manual_seed(0)
    return {name: train_bert(flags, **kwargs) for name, (flags, kwargs) in layouts.items()}


def _references(layouts: dict[str, Layout]) -> dict[str, Run]:
    keys = {name: repr(sorted(kwargs.items())) for name, (_, kwargs) in layouts.items()}
    runs = {key: train_bert("", **kwargs) for name, (_, kwargs) in layouts.items() for key in [keys[name]]}
    return {name: runs[keys[name]] for name in layouts}


def run_bert_layouts(layouts: dict[str, Layout], world_size: int):
    """Every layout on ``world_size`` processes and each one's one-process reference, one spawned job."""
    import functools

    return run_alone_then_workers(functools.partial(_references, layouts), _train_layouts, world_size, layouts)
