"""Sequence-to-sequence fine-tuning of a T5 checkpoint (``finetune.py`` given a T5 checkpoint): the
pre-training loop on ``{"input": ..., "target": ...}`` jsonl examples with teacher forcing.

Each example is encoded as T5's pre-training samples are (``megatrain.data.seq2seq_dataset``): the
input is the encoder's, the decoder reads ``[bos] target`` and predicts ``target [eos]``; the family's
objective gives the ``lm loss``, the mean cross entropy over the target tokens (and the eos) only.
Validation prints Megatron's ``validation loss at iteration N | lm loss value: ... |`` every
``--eval-interval`` over ``--eval-iters`` batches of the ``--valid-data`` examples (cycled in order).

Checkpoints as for classification (``megatrain.training.finetune_classify``): ``--pretrained-checkpoint
DIR`` starts from a pre-trained (or imported) model's weights with a fresh optimizer and iteration
count; ``--load DIR`` holding a checkpoint of this fine-tuning run resumes it; a ``--load`` checkpoint
of pre-training is loaded as with ``--finetune``. The model, tokenizer and sequence-length flags not
given default to the checkpoint's run (for a model imported from Hugging Face: the flags its import
printed); every ``pretrain_t5.py`` flag is accepted.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any, NoReturn, Sequence

from megatrain import checkpoint as checkpointing
from megatrain.data.seq2seq_dataset import (Seq2SeqDataset, Seq2SeqExample, encode_seq2seq_examples,
                                            read_seq2seq_examples)
from megatrain.errors import user_errors_exit
from megatrain.models.registry import get_family
from megatrain.parallel.distributed import setup_env_from_slurm
from megatrain.training.arguments import parse_args, validate_args
from megatrain.training.console import print_rank0
from megatrain.training.finetune_classify import CHECKPOINT_DEFAULT_SECTIONS, _preparse, source_checkpoint, start_from
from megatrain.training.main import family_parser
from megatrain.training.trainer import Trainer, pretrain

__all__ = ["FAMILY", "META_KEY", "Seq2SeqFinetuneTrainer", "build_parser", "saved_run_args", "main"]

FAMILY = "t5"
META_KEY = "seq2seq_finetuning"  # in meta.json: this checkpoint is one of a fine-tuning run (its jsonl keys)
# Flags that stand for each other (Megatron's: one of the two, not both); taken from the checkpoint
# only when neither is given.
_PAIRS = (("num_layers", "encoder_num_layers"), ("seq_length", "encoder_seq_length"))


class Seq2SeqFinetuneTrainer(Trainer):
    """The pre-training loop on encoded input/target examples (the T5 family's objective)."""

    def __init__(self, args: argparse.Namespace, family: Any, examples: tuple[list[Seq2SeqExample],
                                                                              list[Seq2SeqExample]]) -> None:
        self.examples = examples
        super().__init__(args, family=family)

    def build_datasets(self, num_samples: list[int]) -> tuple[Any, Any, Any]:
        a = self.args
        out: list[Seq2SeqDataset | None] = []
        for name, examples, n, seed in (("training", self.examples[0], num_samples[0], a.seed),
                                        ("validation", self.examples[1], num_samples[1], None)):
            if not examples:
                out.append(None)
                continue
            samples, truncated = encode_seq2seq_examples(examples, self.tokenizer, a.encoder_seq_length,
                                                         a.decoder_seq_length)
            if truncated:
                print_rank0(f" note: {truncated} of {len(examples)} {name} examples are cut to --encoder-seq-length "
                            f"({a.encoder_seq_length}) or --decoder-seq-length ({a.decoder_seq_length}, with [bos] "
                            "and [eos])")
            out.append(Seq2SeqDataset(samples, num_samples=n, seed=seed))
        return out[0], out[1], None

    def checkpoint_extra(self) -> dict[str, Any]:
        return {META_KEY: {"input_key": self.args.input_key, "target_key": self.args.target_key}}


def build_parser(checkpoint_meta: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """``pretrain_t5.py``'s flags plus the task's; with ``checkpoint_meta`` the model and tokenizer
    flags default to the checkpoint's run."""
    p = family_parser(FAMILY, prog="finetune.py")
    p.description = ("Fine-tune a T5 checkpoint on jsonl input/target examples (teacher forcing, the loss on the "
                     "target tokens).")
    g = p.add_argument_group("fine-tuning")
    g.add_argument("--train-data", nargs="+", dest="train_data_path", default=None,
                   help='jsonl files of {"input", "target"} training examples')
    g.add_argument("--valid-data", nargs="*", dest="valid_data_path", default=None,
                   help="jsonl files of validation examples (the validation loss every --eval-interval)")
    g.add_argument("--input-key", default="input", help="jsonl key of the encoder's text")
    g.add_argument("--target-key", default="target", help="jsonl key of the decoder's text")
    if checkpoint_meta is not None:
        saved = saved_run_args(checkpoint_meta)
        paired = {d for pair in _PAIRS for d in pair}
        dests = {a.dest for grp in p._action_groups if grp.title in CHECKPOINT_DEFAULT_SECTIONS
                 for a in grp._group_actions} - paired
        defaults = {d: saved[d] for d in sorted(dests) if saved.get(d) is not None}
        if saved.get("decoder_seq_length") is not None:
            defaults["decoder_seq_length"] = saved["decoder_seq_length"]
        if defaults:
            p.set_defaults(**defaults)
    return p


def saved_run_args(meta: dict[str, Any]) -> dict[str, Any]:
    """The run arguments a checkpoint records; for a model imported from Hugging Face (whose record is
    the flags its import printed, ``pretrain_flags``) those flags parsed."""
    saved = dict(meta.get("args") or {})
    flags = saved.get("pretrain_flags")
    if isinstance(flags, list) and all(isinstance(f, str) for f in flags):
        parsed = vars(family_parser(FAMILY).parse_known_args(flags)[0])
        saved = {**parsed, **{k: v for k, v in saved.items() if v is not None}}
    return saved


def _fail(message: str) -> NoReturn:
    raise SystemExit(f"error: {message}")


def _fill_pairs(args: argparse.Namespace, saved: dict[str, Any]) -> None:
    """``--num-layers`` / ``--encoder-num-layers`` (and the encoder length) from the checkpoint when
    neither of the two is given."""
    for general, own in _PAIRS:
        if getattr(args, general) is None and getattr(args, own) is None:
            setattr(args, own, saved.get(own) if saved.get(own) is not None else saved.get(general))


@user_errors_exit
def main(argv: Sequence[str] | None = None) -> None:
    """``finetune.py`` with a T5 checkpoint."""
    setup_env_from_slurm()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = _preparse(argv)
    ckpt, flag = source_checkpoint(pre.load, pre.pretrained_checkpoint, pre.ckpt_step)
    if ckpt is None:
        _fail("T5 fine-tuning starts from a checkpoint: give --pretrained-checkpoint DIR (or --load DIR)")
    meta = checkpointing.read_meta(ckpt)
    family = checkpointing.checkpoint_family(meta)
    if family != FAMILY:
        _fail(f"{flag} {ckpt} holds a {family!r} model; sequence-to-sequence fine-tuning needs a T5 checkpoint")
    args = parse_args(argv, parser=build_parser(meta), validate=False)
    _fill_pairs(args, saved_run_args(meta))
    if args.data_path or args.mock_data:
        _fail("T5 fine-tuning reads jsonl examples from --train-data / --valid-data, not --data-path or --mock-data")
    if not args.train_data_path:
        _fail('give the training examples: --train-data FILE.jsonl [FILE.jsonl ...] ({"input": ..., "target": ...} '
              "a line)")
    if args.test_data_path:
        _fail("--test-data-path is not used by T5 fine-tuning; evaluate with --valid-data")
    resume = flag == "--load" and META_KEY in meta and not args.finetune
    notes = start_from(args, ckpt, flag, resume=resume, why_finetune="a T5 model that was not fine-tuned by this task")
    fam = get_family(FAMILY)
    try:
        if fam.prepare_args is not None:
            fam.prepare_args(args)
        validate_args(args, config_from_args=fam.config_from_args)
    except ValueError as e:
        _fail(str(e))
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and args.decoder_seq_length % tp:
        _fail(f"--sequence-parallel needs --decoder-seq-length ({args.decoder_seq_length}) divisible by "
              f"--tensor-model-parallel-size ({tp})")
    keys = dict(input_key=args.input_key, target_key=args.target_key)
    train = read_seq2seq_examples(args.train_data_path, "--train-data", **keys)
    valid = read_seq2seq_examples(args.valid_data_path, "--valid-data", **keys) if args.valid_data_path else []
    args.legacy_notes += notes
    if meta.get("args"):
        args.legacy_notes.append(f"note: model, tokenizer and length flags not given are taken from {ckpt}")
    args.legacy_notes.append(f"note: sequence-to-sequence fine-tuning: {len(train)} training and {len(valid)} "
                             "validation examples")
    pretrain(args, trainer_class=partial(Seq2SeqFinetuneTrainer, examples=(train, valid)), family=FAMILY)
