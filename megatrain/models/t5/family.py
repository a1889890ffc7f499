"""The T5 family's registry entry: what the trainer, checkpoints and converters use, and what
``pretrain_t5.py`` adds to the general command line (its flags, Megatron's defaults, how its own
flags stand for the general ones, its checks)."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

import torch

from megatrain.data.bert_dataset import BERT_TOKENIZER_TYPES
from megatrain.models.registry import ModelFamily, register
from megatrain.models.t5.checkpoint_compat import CONFIG_CHECKS
from megatrain.models.t5.config import (T5Config, attention_backend_from_args, attention_description,
                                       bias_gradient_from_env, t5_config_from_args)
from megatrain.models.t5.flags import add_t5_flags
from megatrain.models.t5.flops import num_floating_point_operations
from megatrain.models.t5.hf import ADAPTER
from megatrain.models.t5.model import T5Model, initial_value
from megatrain.models.t5.objective import Seq2SeqObjective
from megatrain.models.t5.plan import tensor_parallel_plan
from megatrain.models.t5.stage import PIPELINE_REFUSAL, build_stage

__all__ = ["T5", "prepare_t5_args", "check_t5_args"]

# Flags of GPT's token data that T5's samples have no use for: refused rather than ignored.
_GPT_DATA_FLAGS = (("reset_position_ids", "--reset-position-ids"), ("reset_attention_mask", "--reset-attention-mask"),
                   ("eod_mask_loss", "--eod-mask-loss"))


def _one_of(args: argparse.Namespace, general: str, own: str, what: str) -> int:
    """Megatron's rule for ``--num-layers`` / ``--encoder-num-layers`` (and the sequence lengths): one
    of the two, which then sets the other (both only when they agree: ``--use-checkpoint-args`` may
    have filled the general one)."""
    g, o = getattr(args, general), getattr(args, own)
    flags = f"--{own.replace('_', '-')} (or --{general.replace('_', '-')})"
    if g is not None and o is not None and g != o:
        raise ValueError(f"give --{general.replace('_', '-')} ({g}) or --{own.replace('_', '-')} ({o}), not both "
                         f"(as Megatron-LM): they are the same {what}")
    value = o if o is not None else g
    if value is None:
        raise ValueError(f"{flags} is required")
    setattr(args, general, value)
    setattr(args, own, value)
    return value


def prepare_t5_args(args: argparse.Namespace) -> None:
    """Before the general checks: ``--encoder-num-layers`` is ``--num-layers`` and
    ``--encoder-seq-length`` is ``--seq-length`` (Megatron's rule: either name, not both);
    ``--decoder-num-layers`` defaults to the encoder's; ``--max-position-embeddings`` to the longer
    length. Pipeline and context parallelism are refused here, before their own checks run."""
    if args.pipeline_model_parallel_size > 1:
        raise ValueError(PIPELINE_REFUSAL)
    if getattr(args, "context_parallel_size", 1) > 1:
        raise ValueError("--context-parallel-size > 1 is not supported for T5 (padded encoder and cross-attention); "
                         "use tensor, sequence or data parallelism")
    _one_of(args, "num_layers", "encoder_num_layers", "encoder layers")
    if args.decoder_num_layers is None:
        args.decoder_num_layers = args.num_layers
    encoder = _one_of(args, "seq_length", "encoder_seq_length", "encoder length")
    if args.decoder_seq_length is None:
        raise ValueError("--decoder-seq-length is required (the decoder's input length; Megatron's T5 example "
                         "gives 128 for --encoder-seq-length 512)")
    if args.decoder_seq_length <= 0:
        raise ValueError(f"--decoder-seq-length must be positive, got {args.decoder_seq_length}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = max(encoder, args.decoder_seq_length)
    if args.position_embedding_type == "learned_absolute":
        for flag, length in (("--encoder-seq-length", encoder), ("--decoder-seq-length", args.decoder_seq_length)):
            if length > args.max_position_embeddings:
                raise ValueError(f"{flag} ({length}) is larger than --max-position-embeddings "
                                 f"({args.max_position_embeddings}): learned positions stop there")


def check_t5_args(args: argparse.Namespace) -> None:
    """``pretrain_t5.py``'s own checks (after the general ones): ValueError naming the flag."""
    given = [flag for dest, flag in _GPT_DATA_FLAGS if getattr(args, dest, False)]
    if given:
        raise ValueError(f"{', '.join(given)}: not used by T5's span-corruption data (encoder and decoder "
                         f"sequences, padded); remove {'them' if len(given) > 1 else 'it'}")
    if args.mock_data:
        raise ValueError("--mock-data: there is no mock T5 dataset (Megatron-LM has none either); give "
                         "--data-path with WordPiece data from tools/preprocess_data.py (see docs/t5.md)")
    if args.tokenizer_type not in BERT_TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {args.tokenizer_type}: T5's span corruption needs a WordPiece "
                         f"vocabulary with [CLS]/[SEP]/[MASK]/[PAD] and sentinels: {' or '.join(BERT_TOKENIZER_TYPES)} "
                         "with --vocab-extra-ids (as Megatron-LM's T5)")
    if args.vocab_extra_ids <= 0:
        raise ValueError(f"--vocab-extra-ids {args.vocab_extra_ids}: T5's span corruption replaces every masked "
                         "span by a sentinel <extra_id_i>; give --vocab-extra-ids N (Megatron's example: 100)")
    if not 0.0 < args.mask_prob < 1.0:
        raise ValueError(f"--mask-prob must be in (0, 1), got {args.mask_prob}")
    if not 0.0 <= args.short_seq_prob <= 1.0:
        raise ValueError(f"--short-seq-prob must be in [0, 1], got {args.short_seq_prob}")
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and args.decoder_seq_length % tp:
        raise ValueError(f"--sequence-parallel needs --decoder-seq-length ({args.decoder_seq_length}) divisible "
                         f"by --tensor-model-parallel-size ({tp})")
    from megatrain.models.common.bias_gradient_kernel import lse_tile_from_env

    lse_tile_from_env()  # a malformed MEGATRAIN_BIAS_GRAD_LSE_TILE stops here, not in the first backward
    # How attention will run (FlexAttention or SDPA), printed with the other notes at start-up.
    device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    note = attention_description(attention_backend_from_args(args), args.position_embedding_type,
                                 str(device).split(":")[0], bias_gradient_from_env())
    if isinstance(getattr(args, "legacy_notes", None), list):
        args.legacy_notes.append(f"note: {note}")


def _objective(args: Any, tokenizer: Any) -> Seq2SeqObjective:
    return Seq2SeqObjective()


def _datasets(args: Any, tokenizer: Any, num_samples: Sequence[int | None]):
    from megatrain.data.config import DataConfig
    from megatrain.data.t5_dataset import build_t5_datasets

    return build_t5_datasets(DataConfig.from_args(args), tokenizer, args.encoder_seq_length, args.decoder_seq_length,
                             args.seed, num_samples, mask_prob=args.mask_prob, short_seq_prob=args.short_seq_prob)


T5 = register(ModelFamily(
    name="t5",
    config_class=T5Config,
    config_from_args=t5_config_from_args,
    build_model=T5Model,
    build_stage=build_stage,
    initial_value=initial_value,
    tensor_parallel_plan=tensor_parallel_plan,
    objective=_objective,
    flops=num_floating_point_operations,
    config_checks=CONFIG_CHECKS,
    hf=ADAPTER,
    datasets=_datasets,
    add_flags=add_t5_flags,
    flag_defaults={"tokenizer_type": "BertWordPieceLowerCase"},
    prepare_args=prepare_t5_args,
    check_args=check_t5_args,
    description="T5: an encoder-decoder transformer trained on span corruption (Megatron's T5Model)",
))
