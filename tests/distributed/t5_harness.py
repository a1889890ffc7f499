"""Tiny T5 runs of the real trainer for the layout tests: ``pretrain_t5.py``'s command line
(:func:`megatrain.training.main.parse_family_args`), a tiny WordPiece vocabulary with sentinels, and
synthetic span-corruption samples in the T5 dataset's format (Megatron's field names) fed through the
trainer's ``build_datasets`` hook, the same samples for every layout.

Each sample has encoder and decoder padding (so both padding masks matter), one to three sentinels
in the encoder input, and a decoder input ``[bos] s0 span0 s1 span1 ...`` whose labels are the same
shifted by one and ending in ``[eos]`` (-1 after it).
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

ENC, DEC, MICRO, GLOBAL, STEPS = 16, 8, 2, 8, 4
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [f"w{i}" for i in range(40)]
EXTRA_IDS = 8
PAD, BOS, EOS = 0, 2, 3
FIRST_WORD, SENTINEL = len(SPECIAL), len(SPECIAL) + len(WORDS)  # <extra_id_0> follows the file's tokens


def vocab_file() -> str:
    path = os.path.join(tempfile.gettempdir(), f"megatrain-t5-harness-{os.getpid()}-vocab.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(SPECIAL + WORDS) + "\n")
    return path


def sample(index: int) -> dict[str, Any]:
    """A synthetic T5 sample (the fields of Megatron's T5MaskedWordPieceDataset)."""
    g = np.random.RandomState(7000 + index)
    n_enc, n_spans = int(g.randint(ENC // 2, ENC + 1)), int(g.randint(1, 4))
    text_enc = g.randint(FIRST_WORD, SENTINEL, size=ENC).astype(np.int64)
    for i, position in enumerate(sorted(g.choice(n_enc, n_spans, replace=False))):
        text_enc[position] = SENTINEL + i
    text_enc[n_enc:] = PAD
    decoder = [BOS]
    for i in range(n_spans):
        decoder += [SENTINEL + i, *g.randint(FIRST_WORD, SENTINEL, size=int(g.randint(1, 3))).tolist()]
    decoder = decoder[:DEC]
    n_dec = len(decoder)
    text_dec = np.full(DEC, PAD, np.int64)
    text_dec[:n_dec] = decoder
    labels = np.full(DEC, -1, np.int64)
    labels[:n_dec] = decoder[1:] + [EOS]
    real_dec = (np.arange(DEC) < n_dec).astype(np.int64)
    return {"text_enc": text_enc, "text_dec": text_dec, "labels": labels, "loss_mask": real_dec,
            "truncated": 0, "enc_mask": (np.arange(ENC) < n_enc).astype(np.int64), "dec_mask": real_dec.copy()}


class Samples:
    def __init__(self, size: int, offset: int = 0) -> None:
        self.size, self.offset = size, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:
        return sample(self.offset + i)


class T5HarnessTrainer(Trainer):
    def build_datasets(self, num_samples: list[int]) -> tuple[Any, Any, Any]:
        return Samples(num_samples[0]), Samples(GLOBAL, 100_000), None


def t5_flags(layout: str = "", *, steps: int = STEPS, model: str = "") -> list[str]:
    """``pretrain_t5.py``'s flags of the tiny run; ``model``: more model (or precision) flags (a
    layout's reference gets them too), ``layout``: the parallel layout's flags."""
    flags = ["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--ffn-hidden-size", "64", "--encoder-seq-length", str(ENC),
             "--decoder-seq-length", str(DEC), "--max-position-embeddings", str(ENC),
             "--hidden-dropout", "0", "--attention-dropout", "0", "--no-bias-gelu-fusion",
             "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL), "--train-iters", str(steps),
             "--lr", "1e-2", "--lr-decay-style", "constant", "--weight-decay", "0.1", "--adam-eps", "1e-4",
             "--clip-grad", str(CLIP), "--seed", str(SEED), "--tokenizer-type", "BertWordPieceLowerCase",
             "--vocab-file", vocab_file(), "--vocab-extra-ids", str(EXTRA_IDS), "--make-vocab-size-divisible-by",
             "32", "--data-path", "unused-the-harness-feeds-samples", "--num-workers", "0", "--eval-iters", "1",
             "--device", "cpu"]
    return flags + shlex.split(model) + shlex.split(layout)


def train_t5(layout: str = "", *, steps: int = STEPS, model: str = "", evaluate: bool = True,
             save: str | None = None, stop_after: int | None = None) -> Run:
    """The iterations up to ``steps`` (``--train-iters``; after a ``--load`` in ``layout`` the
    remaining ones), or up to ``stop_after``; with ``save`` a checkpoint there at the end."""
    from megatrain.training.main import parse_family_args

    args = parse_family_args("t5", t5_flags(layout, steps=steps, model=model) + (["--save", save] if save else []))
    trainer = T5HarnessTrainer(args, family="t5")
    try:
        start = trainer.state.iteration
        results = []
        for _ in range(start, stop_after or steps):
            results.append(trainer.train_step())
            trainer.state.iteration += 1  # what the training loop counts after each step
            trainer.state.consumed_train_samples += GLOBAL
        if save:
            trainer.save()
        eval_loss = trainer.evaluate(trainer.valid_iter, 1)["lm loss"] if evaluate else None
        return Run([float(r.loss) for r in results], [r.grad_norm for r in results],
                   full_parameters(trainer.module), {"start": start}, eval_loss)
    finally:
        trainer.close()


# A layout: (flags, keyword arguments of train_t5)
Layout = tuple[str, dict[str, Any]]


def _train_layouts(rank: int, world_size: int, layouts: dict[str, Layout]) -> dict[str, Run]:
    torch.manual_seed(0)
    return {name: train_t5(flags, **kwargs) for name, (flags, kwargs) in layouts.items()}


def _references(layouts: dict[str, Layout]) -> dict[str, Run]:
    """Each layout's one-process run: the same model flags, no layout flag, no checkpoint."""
    def reference(kwargs: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in kwargs.items() if k not in ("save", "stop_after")}

    unique = {repr(sorted(reference(kwargs).items())): reference(kwargs) for _, kwargs in layouts.values()}
    runs = {key: train_t5("", **kwargs) for key, kwargs in unique.items()}  # a shared reference runs once
    return {name: runs[repr(sorted(reference(kwargs).items()))] for name, (_, kwargs) in layouts.items()}


def run_t5_layouts(layouts: dict[str, Layout], world_size: int):
    """Every layout on ``world_size`` processes and each one's one-process reference, one spawned job."""
    import functools

    return run_alone_then_workers(functools.partial(_references, layouts), _train_layouts, world_size, layouts)
