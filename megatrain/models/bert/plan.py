"""How the BERT family is parallelised: its tensor/sequence-parallel plan by module path.

=====================================  =====================================================
module path                            style
=====================================  =====================================================
embedding.word_embeddings              vocab-parallel embedding (rows sharded, sums all-reduced);
                                       position and token-type tables replicated
layers.N.*                             the shared transformer layer's plan
final_layernorm                        sequence parallel under SP; its output is the whole
                                       sequence as a plain tensor (the pooler reads [CLS], the
                                       masked-LM transform every position)
lm_head                                replicated (dense, GELU, LayerNorm on every rank); its
                                       output becomes a replicated DTensor
output_layer                           bias (and an untied weight) sharded on the vocabulary, so
                                       the logits stay vocab-sharded and the loss is the
                                       vocab-parallel cross entropy
pooler, binary_head                    replicated
=====================================  =====================================================
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel

from megatrain.models.common.tp_plan import (ShardParametersOnVocab, TensorParallelPlan, layers_plan,
                                             vocab_parallel_embedding_plan)

__all__ = ["tensor_parallel_plan"]


def tensor_parallel_plan(model: nn.Module, *, sequence_parallel: bool) -> TensorParallelPlan:
    """The plan of a BertModel or of one of its pipeline stages (parts set to None are skipped)."""
    plan = layers_plan(model.layers, model.config, sequence_parallel)
    if model.embedding is not None:
        plan.styles[:0] = vocab_parallel_embedding_plan("embedding", sequence_parallel)
    if model.final_layernorm is not None:
        residual = Shard(1) if sequence_parallel else Replicate()
        if sequence_parallel:
            plan.styles.append(("final_layernorm", SequenceParallel()))
        plan.styles += [
            ("final_layernorm", PrepareModuleOutput(output_layouts=residual, desired_output_layouts=Replicate(),
                                                    use_local_output=True)),
            ("lm_head", PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(),
                                            use_local_output=False)),
            ("output_layer", ShardParametersOnVocab()),
        ]
        plan.vocab_parallel_head = True
    return plan
