"""How the LLaVA family is parallelised: tensor (and sequence) parallelism on the language model, the
vision encoder and projector replicated.

=====================================  =====================================================
module path                            style
=====================================  =====================================================
vision_model.*, projector.*            none: plain parameters, whole on every tensor-parallel
                                       rank (Megatron's replicated encoder)
language_model.*                       the GPT family's plan (:mod:`megatrain.models.gpt.plan`):
                                       vocab-parallel embedding, the transformer layers'
                                       column/row-parallel linears, the vocab-parallel head
language_model (sequence parallel)     :class:`SequenceParallelDecoderInput`: the whole input
                                       (text embeddings with the image features in place) split
                                       on the sequence for the first layer
=====================================  =====================================================

The image features are scattered into the text's embeddings on the whole, replicated sequence
(:meth:`LlavaModel.embed`): the vocab-parallel embedding all-reduces its partial sums, so every rank
holds the whole [b, S, h] embedding. Under sequence parallelism the GPT plan's split of the
embedding's output is left out; the language model's ``decoder_input`` is split instead, after the
scatter (padded at the end to a multiple of the tensor-parallel size: the padded positions come
after every real one, so causal attention keeps them out of the real positions, and their labels
are ignored).

Under pipeline parallelism the first stage (:class:`megatrain.models.llava.stage.LlavaStage`) splits its
input after the scatter itself (:class:`SequenceSplitAfterScatter` gives it the mesh): the run's fixed
length is a multiple of the tensor-parallel size, so nothing is padded, and the later stages run the
GPT plan on their parts as GPT's stages do.

The replicated parts need no gradient reduction: every rank runs them on the same images, and the
gradient reaching the image features is the whole, identical one on every rank (without sequence
parallelism the column-parallel layers all-reduce their input's gradient; with it the split's
backward all-gathers it), so the encoder's and projector's gradients are identical on every rank
and the gradient norm counts them once, as the language model's replicated norms.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel.style import ParallelStyle

from megatrain.models.common.tp_plan import TensorParallelPlan
from megatrain.models.gpt.plan import tensor_parallel_plan as gpt_tensor_parallel_plan
from megatrain.models.llava.tokens import IGNORE_INDEX

__all__ = ["tensor_parallel_plan", "SequenceParallelDecoderInput", "SequenceSplitAfterScatter"]


def tensor_parallel_plan(model: Any, *, sequence_parallel: bool) -> TensorParallelPlan:
    """The plan of a LlavaModel (module docstring): the GPT family's plan on ``language_model``."""
    lm = gpt_tensor_parallel_plan(model.language_model, sequence_parallel=sequence_parallel)
    prefix = "language_model."
    styles = [(prefix + path, style) for path, style in lm.styles
              if not (sequence_parallel and path == "embedding")]  # the split comes after the image scatter
    if sequence_parallel and getattr(model, "num_stages", None) is not None:  # a pipeline stage (stage.py)
        if model.is_first:
            styles.insert(0, ("language_model", SequenceSplitAfterScatter()))
    elif sequence_parallel:
        styles.insert(0, ("language_model", SequenceParallelDecoderInput()))
    return TensorParallelPlan(styles=styles, rng_regions=[prefix + path for path in lm.rng_regions],
                              vocab_parallel_head=lm.vocab_parallel_head)


class SequenceParallelDecoderInput(ParallelStyle):
    """A GPTModel called with ``decoder_input`` (the whole sequence, the same on every rank): the
    input padded at the end to a multiple of the mesh size and split on the sequence (dim 1) for
    the first layer (a ``Replicate`` -> ``Shard(1)`` redistribution: its backward all-gathers the
    gradient); ``position_ids`` and ``labels`` padded with it (further positions, ignored labels);
    the output (the per-token loss, or the logits) cut back to the unpadded length."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        size = device_mesh.size()

        def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            hidden = kwargs.get("decoder_input")
            assert hidden is not None, "the LLaVA language model takes its input as decoder_input"
            args = list(args) + [None] * (4 - len(args))
            input_ids, position_ids, attention_mask, labels = args[:4]
            labels = kwargs.pop("labels", labels)
            if attention_mask is not None:
                raise ValueError("--sequence-parallel: the LLaVA family trains with causal attention (no explicit "
                                 "attention mask)")
            length = hidden.shape[1]
            pad = -length % size
            if pad:
                hidden = F.pad(hidden, (0, 0, 0, pad))
                if position_ids is not None:
                    more = position_ids[..., -1:] + torch.arange(1, pad + 1, device=position_ids.device)
                    position_ids = torch.cat([position_ids, more], dim=-1)
                if labels is not None:
                    labels = F.pad(labels, (0, pad), value=IGNORE_INDEX)
            hidden = DTensor.from_local(hidden, device_mesh, [Replicate()], run_check=False)
            kwargs["decoder_input"] = hidden.redistribute(device_mesh, [Shard(1)]).to_local()
            mod._sp_unpadded_length = length
            return (input_ids, position_ids, attention_mask, labels, *args[4:]), kwargs

        def post_hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            length = mod.__dict__.pop("_sp_unpadded_length", None)
            if length is None or output.shape[1] == length:
                return output
            return output[:, :length]  # the per-token loss (or the vocab-sharded logits' DTensor)

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(post_hook, with_kwargs=True)
        return module


class SequenceSplitAfterScatter(ParallelStyle):
    """The first pipeline stage's ``language_model`` (a :class:`megatrain.models.llava.stage.LlavaStage`
    part): records the mesh on which the stage splits its whole input, after the image scatter, on the
    sequence for the layers (``Replicate`` -> ``Shard(1)``; the run's fixed length is a multiple of
    the mesh size, so nothing is padded here). The later stages get their parts from the previous one."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.sequence_split_mesh = device_mesh
        return module


def split_sequence(hidden: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``hidden`` [b, S, h], the same on every rank of ``mesh`` -> this rank's part of the sequence."""
    if hidden.shape[1] % mesh.size():
        raise ValueError(f"--sequence-parallel: {hidden.shape[1]} positions do not split over {mesh.size()} ranks")
    hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    return hidden.redistribute(mesh, [Shard(1)]).to_local()
