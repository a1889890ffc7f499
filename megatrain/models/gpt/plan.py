"""How the GPT family is parallelised: its tensor/sequence-parallel plan by module path.

=====================================  =====================================================
module path                            style
=====================================  =====================================================
embedding.word_embeddings              vocab-parallel embedding (rows sharded, sums all-reduced)
layers.N.*                             the shared transformer layer's plan
                                       (:func:`megatrain.models.common.tp_plan.transformer_layer_plan`)
final_layernorm, output_layer          column parallel over the vocabulary (or the tied
                                       embedding): logits stay sharded, and the loss is the
                                       vocab-parallel cross entropy
=====================================  =====================================================

A pipeline stage holds some of these modules; the plan names only those it has. Pipeline stages,
recomputation units (``layers``) and initialisation rules are in ``stage.py`` and ``model.py``.
"""

from __future__ import annotations

from torch import nn

from megatrain.models.common.tp_plan import TensorParallelPlan, layers_plan, lm_head_plan, vocab_parallel_embedding_plan

__all__ = ["tensor_parallel_plan"]


def tensor_parallel_plan(model: nn.Module, *, sequence_parallel: bool) -> TensorParallelPlan:
    """The plan of a GPTModel or of one of its pipeline stages (parts set to None are skipped)."""
    plan = layers_plan(model.layers, model.config, sequence_parallel)
    if model.embedding is not None:
        plan.styles[:0] = vocab_parallel_embedding_plan("embedding", sequence_parallel)
    if model.final_layernorm is not None:
        output_layer = "output_layer" if model.output_layer is not None else None
        plan.styles += lm_head_plan("final_layernorm", output_layer, sequence_parallel)
        plan.vocab_parallel_head = True
    return plan
