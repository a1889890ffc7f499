"""BERT for sequence classification (Megatron-LM's ``tasks/`` ``Classification`` model): the BERT
body and pooler, dropout, and a new classification head ``[h -> num_classes]`` on the pooled
``[CLS]`` output.

:class:`BertClassificationModel` is a :class:`~megatrain.models.bert.model.BertModel` without the
pre-training heads: it reuses the embedding, the layers (``encode``), the final norm and the pooler
under BertModel's own parameter names, so a pre-trained BERT checkpoint loads into it with
``--finetune`` (the masked-LM transform, output bias and sentence-order head of the checkpoint are
not used; a checkpoint trained with ``--bert-no-binary-head`` has no pooler, which then starts fresh).
New modules:

    pooler.dense                 (kept from the checkpoint when it has one)
    classification_dropout       dropout with --hidden-dropout
    classification_head          [h -> num_classes], weight N(0, --init-method-std), bias 0

The model always has two token types (segments A and B), as Megatron's classification model does.

:func:`classification_family` is the BERT family with this model, its objective (the mean cross
entropy over the micro-batch's examples, logged as ``classification loss``), initialisation rules
and tensor-parallel plan; the checkpoints it writes are BERT checkpoints (same config class).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, ClassVar, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel

from megatrain.data.batch import Batch
from megatrain.models.bert.config import BertConfig
from megatrain.models.bert.family import BERT
from megatrain.models.bert.model import BertModel, Pooler, initial_value
from megatrain.models.common.init import canonical_parameter_name, megatron_initial_value
from megatrain.models.common.objective import Objective
from megatrain.models.common.tp_plan import TensorParallelPlan, layers_plan, vocab_parallel_embedding_plan
from megatrain.models.registry import ModelFamily

__all__ = ["BertClassificationModel", "ClassificationBatch", "ClassificationObjective", "classification_family",
           "classification_config", "classification_initial_value", "classification_tensor_parallel_plan",
           "NUM_TOKENTYPES", "META_KEY"]

NUM_TOKENTYPES = 2  # segments A and B, whatever the pre-trained model had
# The meta.json entry of a classification checkpoint: {"num_classes": N, "labels": [names] or null}.
META_KEY = "classification"


def classification_config(config: BertConfig) -> BertConfig:
    """The BERT config of a classification model: two token types (Megatron's ``num_tokentypes=2``)."""
    return config if config.num_tokentypes == NUM_TOKENTYPES else replace(config, num_tokentypes=NUM_TOKENTYPES)


class BertClassificationModel(BertModel):
    """``forward(tokens, padding_mask, tokentype_ids)`` -> class logits [b, num_classes]:
    embedding -> layers -> final norm -> pooler (tanh(dense) on ``[CLS]``) -> dropout -> head."""

    def __init__(self, config: BertConfig, num_classes: int) -> None:
        if num_classes < 1:
            raise ValueError(f"a classification model needs at least one class, got {num_classes}")
        super().__init__(config)
        self.num_classes = num_classes
        # The pre-training heads are not part of this model (their checkpoint tensors stay unused).
        self.lm_head = None
        self.output_layer = None
        self.binary_head = None
        del self.loss_head  # no language-model head: the parallel code must not install a vocabulary loss
        if self.pooler is None:  # a model pre-trained without the binary head has no pooler
            self.pooler = Pooler(config)
        self.classification_dropout = nn.Dropout(config.hidden_dropout)
        self.classification_head = nn.Linear(config.hidden_size, num_classes)
        if not next(self.parameters()).is_meta:
            self.init_weights(seed=0)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None,  # type: ignore[override]
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.encoder_output(tokens, padding_mask, tokentype_ids)
        assert self.final_layernorm is not None and self.pooler is not None
        pooled = self.pooler(self.final_layernorm(hidden))
        return self.classification_head(self.classification_dropout(pooled))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        for name, param in self.named_parameters():
            param.copy_(classification_initial_value(name, param.shape, self.config, seed))


def classification_initial_value(name: str, shape: Sequence[int], config: BertConfig, seed: int) -> torch.Tensor:
    """BERT's rules (:func:`megatrain.models.bert.model.initial_value`), and for the classification
    head Megatron's ``init_method_normal``: weight N(0, std), bias 0."""
    if canonical_parameter_name(name).startswith("classification_head."):
        return megatron_initial_value(name, shape, config, seed, std_weights={"classification_head"})
    return initial_value(name, shape, config, seed)


def classification_tensor_parallel_plan(model: nn.Module, *, sequence_parallel: bool) -> TensorParallelPlan:
    """BERT's plan for the embedding and layers; the final norm's output becomes the whole sequence
    as a plain tensor, so the pooler and the classification head run replicated on every rank."""
    plan = layers_plan(model.layers, model.config, sequence_parallel)
    plan.styles[:0] = vocab_parallel_embedding_plan("embedding", sequence_parallel)
    if sequence_parallel:
        plan.styles.append(("final_layernorm", SequenceParallel()))
    residual = Shard(1) if sequence_parallel else Replicate()
    plan.styles.append(("final_layernorm", PrepareModuleOutput(output_layouts=residual,
                                                               desired_output_layouts=Replicate(),
                                                               use_local_output=True)))
    return plan


@dataclass
class ClassificationBatch(Batch):
    """Sequence-classification micro-batches: ``[CLS] A [SEP] (B [SEP])`` token ids, token types
    (0 for A, 1 for B), the padding mask (True = a real token) and one class label per sequence."""

    tokens: torch.Tensor  # int64 [b, s]
    tokentype_ids: torch.Tensor  # int64 [b, s]
    padding_mask: torch.Tensor  # bool [b, s]
    labels: torch.Tensor  # int64 [b]

    sequence_fields: ClassVar[tuple[str, ...]] = ("tokens", "tokentype_ids", "padding_mask")


class ClassificationObjective(Objective):
    """The cross entropy of each example's class logits, averaged over the micro-batch's examples
    (``classification loss``). Samples are dicts of ``tokens``, ``types``, ``padding_mask`` [b, s]
    and ``label`` [b]."""

    loss_names = ("classification loss",)

    def make_batch(self, samples: dict[str, torch.Tensor]) -> ClassificationBatch:
        return ClassificationBatch(tokens=samples["tokens"].long(), tokentype_ids=samples["types"].long(),
                                   padding_mask=samples["padding_mask"] != 0, labels=samples["label"].long().view(-1))

    def logits(self, model: Any, batch: ClassificationBatch) -> torch.Tensor:
        return model(batch.tokens, padding_mask=batch.padding_mask, tokentype_ids=batch.tokentype_ids)

    def forward(self, model: Any, batch: ClassificationBatch) -> torch.Tensor:
        return F.cross_entropy(self.logits(model, batch).float(), batch.labels, reduction="none")

    def loss_target(self, batch: ClassificationBatch) -> torch.Tensor:
        return torch.ones(batch.labels.shape, dtype=torch.float32, device=batch.labels.device)

    def losses(self, output: torch.Tensor, target: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        weights = target.to(output.dtype)
        return [((output * weights).sum(), weights.sum())]

    def stage_inputs(self, batch: Any, *, first: bool, last: bool) -> tuple[tuple, dict[str, Any]]:
        raise ValueError("classification fine-tuning does not support --pipeline-model-parallel-size > 1")


def _no_pipeline_stage(config: BertConfig, layer_ids: Sequence[int], *, stage_index: int, num_stages: int) -> Any:
    raise ValueError("classification fine-tuning does not support --pipeline-model-parallel-size > 1; use tensor "
                     "or data parallelism")


def _config_from_args(args: Any, vocab_size: int) -> BertConfig:
    assert BERT.config_from_args is not None
    return classification_config(BERT.config_from_args(args, vocab_size))


def _objective(args: Any, tokenizer: Any) -> ClassificationObjective:
    return ClassificationObjective()


def classification_family(num_classes: int) -> ModelFamily:
    """The BERT family building :class:`BertClassificationModel` with ``num_classes`` classes (for the
    trainer; it keeps the name ``bert``, so its checkpoints are BERT checkpoints)."""
    return replace(BERT, config_from_args=_config_from_args,
                   build_model=partial(BertClassificationModel, num_classes=num_classes),
                   build_stage=_no_pipeline_stage, initial_value=classification_initial_value,
                   tensor_parallel_plan=classification_tensor_parallel_plan, objective=_objective,
                   datasets=None, hf=None, memory=None,
                   description=f"BERT for sequence classification ({num_classes} classes)")
