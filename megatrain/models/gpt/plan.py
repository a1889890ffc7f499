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
mtp.layers.N.transformer_layer.*       the shared transformer layer's plan
mtp.layers.N.hnorm                     takes the depth before's replicated output (a DTensor):
                                       whole, or this rank's part of the sequence under
                                       sequence parallelism
mtp.layers.N.enorm, .eh_proj           replicated; sequence parallel under sequence parallelism
mtp.layers.N.final_layernorm           as final_layernorm: its output replicated for the head
=====================================  =====================================================

A pipeline stage holds some of these modules; the plan names only those it has. Pipeline stages,
recomputation units (``layers``) and initialisation rules are in ``stage.py`` and ``model.py``.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

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
    if getattr(model, "mtp", None) is not None:
        depths = {f"{k}.transformer_layer": depth.transformer_layer for k, depth in model.mtp.layers.items()}
        inner = layers_plan(depths, model.config, sequence_parallel, prefix="mtp.layers")  # type: ignore[arg-type]
        plan.styles += inner.styles
        plan.rng_regions += inner.rng_regions
        for k in model.mtp.layers:
            plan.styles += _mtp_depth_plan(f"mtp.layers.{k}", sequence_parallel)
    return plan


def _mtp_depth_plan(path: str, sequence_parallel: bool) -> list[tuple[str, Any]]:
    """A multi-token prediction depth's norms and projection around its transformer layer: the hidden
    states come replicated (the head's layout), the embeddings and the layer's residual stream as the
    decoder's; the final norm hands the head a replicated DTensor, as the decoder's does."""
    residual = Shard(1) if sequence_parallel else Replicate()
    styles: list[tuple[str, Any]] = [
        (f"{path}.hnorm", PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(residual,),
                                             use_local_output=True))]
    if sequence_parallel:
        styles += [(f"{path}.{name}", SequenceParallel(use_local_output=True))
                   for name in ("hnorm", "enorm", "eh_proj")]
    return styles + lm_head_plan(f"{path}.final_layernorm", None, sequence_parallel)
