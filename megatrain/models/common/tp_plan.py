"""Tensor- and sequence-parallel plans by module path, as data: what a family hands the parallel code.

A plan is a list of (module path, torch ``ParallelStyle``) pairs applied in order (a module may get
several styles: a norm's sequence-parallel input, then its output layout), the paths of the dropout
regions whose random masks must differ per rank, and whether the language-model head becomes the
vocab-parallel cross entropy. ``megatrain.parallel.tensor_parallel.apply_tensor_parallel`` applies it.

:func:`transformer_layer_plan` is the plan of the shared transformer layer (Megatron's layout):

=====================================  =====================================================
self_attention.linear_qkv              column parallel; the grouped [g, n/g + 2, d] row layout
                                       makes Shard(0) give every rank whole query groups (GQA too)
self_attention.linear_proj             row parallel
self_attention.q_/k_layernorm          (--qk-layernorm) weights replicated, input the rank's heads
                                       (:class:`HeadShardedNorm`): their gradients sum over ranks
multi-latent attention                 linear_q_proj / linear_q_up_proj and linear_kv_up_proj column
                                       parallel (whole heads); down projections and latent norms
                                       replicated; k_pos_emb_region (the rotated key every head
                                       shares) all-reduces its gradient (:class:`CopyToTensorParallelRegion`)
cross_attention.linear_q, linear_kv    column parallel (a decoder layer of an encoder-decoder);
                                       the [n, 2, d] key/value rows keep whole heads per rank
cross_attention.linear_proj            row parallel
mlp.linear_fc1                         column parallel; SwiGLU rows are interleaved gate/up per
                                       channel, so Shard(0) keeps each pair on one rank
mlp.linear_fc2                         row parallel
=====================================  =====================================================

With sequence parallelism the residual stream between blocks is sharded on the sequence dim (dim
1): norms run on ``Shard(1)`` (SequenceParallel), attention and MLP all-gather their input
(PrepareModuleInput) and reduce-scatter their output (RowwiseParallel to Shard(1)). Cross-attention
gathers its queries' input the same way; its context (the encoder output) comes whole and replicated.

A mixture-of-experts layer's ``mlp`` (a ``MoELayer``) gets none of the dense MLP's styles: each rank
routes the tokens it holds (under sequence parallelism its part of the sequence: ``mlp`` only takes
its input as the local tensor, no gather), and the router and experts are laid out by
:mod:`megatrain.parallel.expert_parallel` (router replicated, experts whole or sharded over ``ep``).
Its shared experts are a dense MLP of their own: ``mlp.shared_experts.linear_fc1`` column parallel
(gathering the sequence itself under sequence parallelism), ``linear_fc2`` row parallel back to the
residual layout; with sequence parallelism and ``--moe-shared-expert-gate`` the gate weight becomes a
replicated DTensor and the shared experts' input a ``Shard(1)`` DTensor (:class:`SharedExpertGateParallel`),
so the gate's gradient sums every rank's part of the sequence.

With ``--qk-layernorm`` the per-head query and key norms (width ``d``, shared by all heads) see only
the rank's heads: :class:`HeadShardedNorm` makes their weights replicated DTensors and their input a
DTensor sharded on the head dim, so each weight's gradient is the sum of every rank's heads' parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel)
from torch.distributed.tensor.parallel.style import ParallelStyle

__all__ = ["TensorParallelPlan", "transformer_layer_plan", "layers_plan", "vocab_parallel_embedding_plan",
           "lm_head_plan", "ShardParametersOnVocab", "SharedExpertGateParallel", "HeadShardedNorm",
           "CopyToTensorParallelRegion"]


@dataclass
class TensorParallelPlan:
    styles: list[tuple[str, Any]] = field(default_factory=list)  # (module path, ParallelStyle), in order
    rng_regions: list[str] = field(default_factory=list)  # modules whose dropout masks differ per rank
    vocab_parallel_head: bool = False  # the model's loss_head becomes the vocab-parallel cross entropy


def transformer_layer_plan(sequence_parallel: bool, cross_attention: bool = False, *, moe: bool = False,
                           shared_experts: bool = False, shared_expert_gate: bool = False,
                           qk_layernorm: bool = False, mla: str | None = None) -> dict[str, Any]:
    """The plan of one transformer layer (with ``cross_attention``: a decoder layer that has one),
    keyed by module path relative to the layer. ``moe``: its ``mlp`` is a mixture-of-experts layer
    (with ``shared_experts``, gated with ``shared_expert_gate``); ``qk_layernorm``: its self-attention
    has per-head query and key norms; ``mla``: its self-attention is multi-latent attention, with a query
    bottleneck ("q_lora") or without ("direct")."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {}
    if mla is None:
        plan["self_attention.linear_qkv"] = ColwiseParallel()
    else:  # the latents replicated, their up projections split by heads
        plan.update({
            "self_attention.linear_q_up_proj" if mla == "q_lora" else "self_attention.linear_q_proj": ColwiseParallel(),
            "self_attention.linear_kv_up_proj": ColwiseParallel(),
            "self_attention.k_pos_emb_region": CopyToTensorParallelRegion(),
        })
    plan["self_attention.linear_proj"] = RowwiseParallel(output_layouts=residual)
    if qk_layernorm:
        plan.update({"self_attention.q_layernorm": HeadShardedNorm(), "self_attention.k_layernorm": HeadShardedNorm()})
    if cross_attention:
        plan.update({
            "cross_attention.linear_q": ColwiseParallel(),
            "cross_attention.linear_kv": ColwiseParallel(),
            "cross_attention.linear_proj": RowwiseParallel(output_layouts=residual),
        })
    if not moe:
        plan.update({
            "mlp.linear_fc1": ColwiseParallel(),
            "mlp.linear_fc2": RowwiseParallel(output_layouts=residual),
        })
    elif shared_experts:
        plan.update({
            # the layer input (this rank's sequence part under SP) gathered by the column-parallel fc1
            "mlp.shared_experts.linear_fc1": ColwiseParallel(input_layouts=residual),
            "mlp.shared_experts.linear_fc2": RowwiseParallel(output_layouts=residual),
        })
    if sequence_parallel:
        plan.update({
            "input_layernorm": SequenceParallel(),
            "pre_mlp_layernorm": SequenceParallel(),
            # SelfAttention.forward(x, position_ids, attention_mask, kv_cache): gather x only.
            "self_attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                 desired_input_layouts=(Replicate(), None, None, None),
                                                 use_local_output=True),
            # a MoE layer routes this rank's tokens: its input stays the sequence part, as a local tensor
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Shard(1) if moe else Replicate(),),
                                      use_local_output=True),
        })
        if moe and shared_experts and shared_expert_gate:
            plan["mlp.shared_experts"] = SharedExpertGateParallel()
        if cross_attention:
            plan.update({
                "pre_cross_attn_layernorm": SequenceParallel(),
                # CrossAttention.forward(x, context, context_mask): gather x; the context is whole.
                "cross_attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                      desired_input_layouts=(Replicate(), None, None),
                                                      use_local_output=True),
            })
    return plan


def layers_plan(layers: nn.ModuleDict, config: Any, sequence_parallel: bool, prefix: str = "layers"
                ) -> TensorParallelPlan:
    """Every layer of ``layers`` with :func:`transformer_layer_plan`; the dropout regions to fork
    (attention dropout on local heads; residual dropout on the rank's part of the sequence). Without
    dropout there is no randomness to fork (and the fork would split compiled graphs)."""
    plan = TensorParallelPlan()
    for key, layer in layers.items():
        cross = getattr(layer, "cross_attention", None) is not None
        mlp = getattr(layer, "mlp", None)
        mlp = getattr(mlp, "_checkpoint_wrapped_module", mlp)
        moe = type(mlp).__name__ == "MoELayer"
        shared = getattr(mlp, "shared_experts", None) if moe else None
        gate = shared is not None and getattr(shared, "gate_weight", None) is not None
        attention = getattr(layer, "self_attention", None)
        mla = None
        if type(attention).__name__ == "MLASelfAttention":
            mla = "direct" if getattr(attention, "q_lora_rank", None) is None else "q_lora"
        qk_norm = mla is None and getattr(attention, "q_layernorm", None) is not None
        for path, style in transformer_layer_plan(sequence_parallel, cross, moe=moe, shared_experts=shared is not None,
                                                  shared_expert_gate=gate, qk_layernorm=qk_norm, mla=mla).items():
            plan.styles.append((f"{prefix}.{key}.{path}", style))
        if config.attention_dropout > 0:
            plan.rng_regions.append(f"{prefix}.{key}.self_attention.core_attention")
            if cross:
                plan.rng_regions.append(f"{prefix}.{key}.cross_attention.core_attention")
        if sequence_parallel and config.hidden_dropout > 0:
            plan.rng_regions.append(f"{prefix}.{key}.dropout")
    return plan


def vocab_parallel_embedding_plan(path: str, sequence_parallel: bool) -> list[tuple[str, Any]]:
    """The embedding module at ``path`` (with a ``word_embeddings`` table): rows of the table sharded,
    partial sums all-reduced; under sequence parallelism each rank then keeps its part of the
    sequence (the backward all-gathers the gradient)."""
    styles: list[tuple[str, Any]] = [
        (f"{path}.word_embeddings", RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))]
    if sequence_parallel:
        styles.append((path, PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                                 use_local_output=True)))
    return styles


def lm_head_plan(final_norm: str, output_layer: str | None, sequence_parallel: bool) -> list[tuple[str, Any]]:
    """The final norm (sequence parallel) and a language-model head whose logits stay sharded on the
    vocabulary: the norm's output becomes a replicated DTensor, so the tied ``F.linear`` with the
    vocab-sharded embedding table (or the column-parallel ``output_layer``) yields vocab-sharded logits."""
    residual = Shard(1) if sequence_parallel else Replicate()
    styles: list[tuple[str, Any]] = []
    if sequence_parallel:
        styles.append((final_norm, SequenceParallel()))
    styles.append((final_norm, PrepareModuleOutput(output_layouts=residual, desired_output_layouts=Replicate(),
                                                   use_local_output=False)))
    if output_layer is not None:
        styles.append((output_layer, ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                                     use_local_output=False)))
    return styles


class ShardParametersOnVocab(ParallelStyle):
    """Every parameter of the module sharded on dim 0 (the vocabulary) as a DTensor, nothing else:
    for an output layer whose forward is a plain ``F.linear`` (BERT's: its bias, and its weight when
    untied), so that a replicated input gives vocab-sharded logits."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for param_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        return distribute_module(module, device_mesh, partition)


class SharedExpertGateParallel(ParallelStyle):
    """A MoE layer's gated shared experts under sequence parallelism: ``gate_weight`` [1, h] becomes a
    replicated DTensor and the module's input (this rank's part of the sequence) a ``Shard(1)``
    DTensor, so ``sigmoid(x @ gate_weight^T)`` is computed on the rank's tokens and the gate's
    gradient is the sum of every rank's part. The linear layers inside keep their own styles (fc1
    gathers the DTensor input); the module returns a local tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if mod is module and isinstance(getattr(mod, "gate_weight", None), nn.Parameter):
                gate = mod.gate_weight
                if not isinstance(gate, DTensor):
                    mod.register_parameter("gate_weight", nn.Parameter(
                        distribute_tensor(gate, mesh, [Replicate()]), requires_grad=gate.requires_grad))

        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            x, *rest = inputs
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
            return (x, *rest)

        return distribute_module(module, device_mesh, partition, prepare_input)


class HeadShardedNorm(ParallelStyle):
    """A per-head norm (``--qk-layernorm``: width ``d``, one weight for every head) whose input
    [b, heads, s, d] holds only this rank's heads: its parameters become replicated DTensors and its
    input a DTensor sharded on the head dim (dim 1), so the norm runs on the local heads and each
    parameter's gradient is the sum of every rank's part (a partial sum, all-reduced). Returns the
    local tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for param_name, param in list(mod.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):
                    mod.register_parameter(param_name, nn.Parameter(
                        distribute_tensor(param, mesh, [Replicate()]), requires_grad=param.requires_grad))

        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            x, *rest = inputs
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
            return (x, *rest)

        def prepare_output(mod: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)


class CopyToTensorParallelRegion(ParallelStyle):
    """A parameter-free module whose input, replicated on every rank, is then used by this rank's heads
    only (multi-latent attention's shared rotated key): identity forward, its gradient all-reduced over
    the ranks in backward (Megatron's copy-to-tensor-parallel region), so the replicated projection
    before it gets the whole gradient. Returns a local tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            x, *rest = inputs
            if isinstance(x, DTensor):
                x = x.to_local()
            shared = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return (shared.to_local(grad_placements=[Partial()]), *rest)

        return distribute_module(module, device_mesh, input_fn=prepare_input)
