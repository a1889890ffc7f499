"""How the T5 family is parallelised: its tensor/sequence-parallel plan by module path.

=====================================  =====================================================
module path                            style
=====================================  =====================================================
embedding.word_embeddings              vocab-parallel embedding (rows sharded, sums all-reduced),
                                       for the encoder's and the decoder's tokens alike; under
                                       SP each rank keeps its part of either sequence
*_relative_pos_emb.relative_attention  the [buckets, heads] table sharded on the heads (column
_bias                                  parallel): each rank computes the bias of its own heads
encoder.layers.N.*                     the shared transformer layer's plan
encoder.final_layernorm                sequence parallel under SP; its output (the encoder
                                       output every cross-attention reads) whole and replicated
decoder.layers.N.*                     the shared layer's plan with cross-attention: linear_q and
                                       linear_kv column parallel, linear_proj row parallel
decoder.final_layernorm                sequence parallel under SP; its output a replicated DTensor
output_layer                           bias (tied) or weight (untied) sharded on the vocabulary,
                                       so the logits stay vocab-sharded and the loss is the
                                       vocab-parallel cross entropy
=====================================  =====================================================
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, SequenceParallel

from megatrain.models.common.tp_plan import (ShardParametersOnVocab, TensorParallelPlan, layers_plan,
                                             vocab_parallel_embedding_plan)

__all__ = ["tensor_parallel_plan"]


def _final_norm(path: str, sequence_parallel: bool, *, local: bool) -> list[tuple[str, object]]:
    """A stack's final norm: sequence parallel under SP, its output gathered and replicated (a plain
    tensor when ``local``, else a DTensor for the vocab-sharded logits)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    styles: list[tuple[str, object]] = [(path, SequenceParallel())] if sequence_parallel else []
    styles.append((path, PrepareModuleOutput(output_layouts=residual, desired_output_layouts=Replicate(),
                                             use_local_output=local)))
    return styles


def tensor_parallel_plan(model: nn.Module, *, sequence_parallel: bool) -> TensorParallelPlan:
    """The plan of a T5Model."""
    config = model.config
    plan = TensorParallelPlan()
    plan.styles += vocab_parallel_embedding_plan("embedding", sequence_parallel)
    for table in ("encoder_relative_pos_emb", "decoder_relative_pos_emb"):
        if getattr(model, table) is not None:
            plan.styles.append((f"{table}.relative_attention_bias", ColwiseParallel()))
    for stack in ("encoder", "decoder"):
        layers = layers_plan(getattr(model, stack).layers, config, sequence_parallel, prefix=f"{stack}.layers")
        plan.styles += layers.styles
        plan.rng_regions += layers.rng_regions
        plan.styles += _final_norm(f"{stack}.final_layernorm", sequence_parallel, local=stack == "encoder")
    plan.styles.append(("output_layer", ShardParametersOnVocab()))
    plan.vocab_parallel_head = True
    return plan
