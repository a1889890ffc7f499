"""The BERT family's registry entry: what the trainer, pipeline, checkpoints and converters use,
and what ``pretrain_bert.py`` adds to the general command line."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from megatrain.data.bert_dataset import BERT_TOKENIZER_TYPES
from megatrain.models.bert.checkpoint_compat import CONFIG_CHECKS
from megatrain.models.bert.config import BertConfig, bert_config_from_args
from megatrain.models.bert.flags import add_bert_flags
from megatrain.models.bert.flops import num_floating_point_operations
from megatrain.models.bert.hf import ADAPTER
from megatrain.models.bert.model import BertModel, initial_value
from megatrain.models.bert.objective import MaskedLMObjective
from megatrain.models.bert.plan import tensor_parallel_plan
from megatrain.models.bert.stage import BertStage
from megatrain.models.registry import ModelFamily, register

__all__ = ["BERT", "check_bert_args"]

# Flags of GPT's token data that BERT's samples have no use for: refused rather than ignored.
_GPT_DATA_FLAGS = (("reset_position_ids", "--reset-position-ids"), ("reset_attention_mask", "--reset-attention-mask"),
                   ("eod_mask_loss", "--eod-mask-loss"), ("mock_data", "--mock-data"))


def check_bert_args(args: argparse.Namespace) -> None:
    """``pretrain_bert.py``'s own checks (after the general ones): ValueError naming the flag."""
    given = [flag for dest, flag in _GPT_DATA_FLAGS if getattr(args, dest, False)]
    if given:
        raise ValueError(f"{', '.join(given)}: not used by BERT's masked-LM data (sentence pairs with [CLS]/[SEP], "
                         f"padded); remove {'them' if len(given) > 1 else 'it'}")
    if args.tokenizer_type not in BERT_TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {args.tokenizer_type}: BERT's masked-LM data needs a WordPiece "
                         f"vocabulary with [CLS]/[SEP]/[MASK]/[PAD]: {' or '.join(BERT_TOKENIZER_TYPES)}")
    if getattr(args, "context_parallel_size", 1) > 1:
        raise ValueError("--context-parallel-size > 1 is not supported for BERT (padded bidirectional "
                         "attention); use tensor, sequence, pipeline or data parallelism")
    if not 0.0 < args.mask_prob < 1.0:
        raise ValueError(f"--mask-prob must be in (0, 1), got {args.mask_prob}")
    if not 0.0 <= args.short_seq_prob <= 1.0:
        raise ValueError(f"--short-seq-prob must be in [0, 1], got {args.short_seq_prob}")
    if args.seq_length < 5:
        raise ValueError(f"--seq-length {args.seq_length} leaves no room for a BERT sample: [CLS] A [SEP] B [SEP] "
                         "needs at least 5 positions (as Megatron asserts)")


def _objective(args: Any, tokenizer: Any) -> MaskedLMObjective:
    return MaskedLMObjective.from_args(args)


def _datasets(args: Any, tokenizer: Any, num_samples: Sequence[int | None]):
    from megatrain.data.bert_dataset import build_bert_datasets
    from megatrain.data.config import DataConfig

    return build_bert_datasets(DataConfig.from_args(args), tokenizer, args.seq_length, args.seed, num_samples,
                               mask_prob=args.mask_prob, short_seq_prob=args.short_seq_prob,
                               binary_head=args.bert_binary_head)


BERT = register(ModelFamily(
    name="bert",
    config_class=BertConfig,
    config_from_args=bert_config_from_args,
    build_model=BertModel,
    build_stage=BertStage,
    initial_value=initial_value,
    tensor_parallel_plan=tensor_parallel_plan,
    objective=_objective,
    flops=num_floating_point_operations,
    config_checks=CONFIG_CHECKS,
    hf=ADAPTER,
    datasets=_datasets,
    add_flags=add_bert_flags,
    flag_defaults={"tokenizer_type": "BertWordPieceLowerCase"},
    check_args=check_bert_args,
    description="BERT: a bidirectional encoder with masked-LM and sentence-order heads (Megatron's BertModel)",
))
