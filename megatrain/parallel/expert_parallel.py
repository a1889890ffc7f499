"""Expert parallelism for mixture-of-experts layers: which ranks hold which experts, the router's
process groups and tensor-parallel style, and how the expert gradients are reduced.

Layout (Megatron's "parallel folding"): the ``N = dp x cp x tp`` ranks of each pipeline stage are laid
out again as ``(edp, ep)`` with ``ep`` innermost (:meth:`ParallelDims.expert_mesh`, axes
``("pp", "edp", "ep")``). Every rank routes only its own tokens (its batch, its sequence part under
sequence / context parallelism); an expert group of ``ep`` consecutive ranks holds the ``E`` experts,
``E / ep`` each, and a token dispatcher (:mod:`megatrain.parallel.expert_dispatch`) moves the tokens.

:func:`apply_expert_parallel` (run by ``parallelize_model`` after the tensor-parallel plan):

* ``mlp.experts.*`` parameters ([E, ...]) become DTensors ``Shard(0)`` on the ``ep`` mesh (with ``ep`` 1
  they stay plain); the checkpoint holds their global shapes, so it loads under any ``ep``;
* ``mlp.dispatcher`` becomes the all-to-all or all-gather dispatcher over the ``ep`` group;
* ``mlp.router``: ``reduce_group`` = the ranks holding other tokens of the same sequences (tensor
  parallel under sequence parallelism, x context parallel; Megatron's tp_cp group) and ``global_group``
  = every rank of the stage holding distinct tokens (data x context x sequence parallel; Megatron's
  tp_dp_cp); with tensor parallelism its weight is a replicated DTensor on the ``tp`` mesh
  (:class:`RouterParallel`), so its partial gradients from each rank's sequence part are summed.

Gradients. The right gradient of every parameter is ``1 / (dp x cp)`` times the sum over the stage's
token-distinct ranks of their local gradients (the trainer already weights each rank's loss). The
non-expert parameters get it from the layers' FSDP2 over the data x context ranks (the average) and
DTensor's sums over ``tp``. An expert weight's local gradient already holds every token its expert
group sent it; :func:`megatrain.parallel.data_parallel.apply_fsdp` wraps each MoE layer's
``mlp.experts`` in its own ``fully_shard`` over the ``edp`` mesh (before the layer's, as torchtitan
does), which averages over ``edp``; the dispatcher then scales the experts' weight gradients by
:func:`expert_grad_scale` ``f = edp / (dp x cp x t)`` (``t = tp`` when the tensor-parallel ranks see
the same tokens, i.e. without sequence parallelism, else 1), so the result is that sum over
``dp x cp``. (FSDP2's own divide factor would do the same, but it needs a pre-multiplied reduction
that gloo lacks.) Any distributed run of a MoE model therefore uses FSDP2 for the whole model (never
DDP, which would average the experts over ``dp``). Gradient norms count each expert shard once: its
DTensor gradient lives on the 2-D ``(edp, ep)`` mesh (flattened once, so its norm is one all-reduce).

Pipeline parallelism: each stage's sub-meshes come from the ``pp`` axis of both meshes;
:func:`keep_router_state_through_metadata_inference` keeps torch's first-step metadata pass out of
the routers' counts.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

from megatrain.parallel.dims import ParallelDims

__all__ = ["moe_layers", "expert_grad_scale", "router_groups", "RouterParallel", "apply_expert_parallel",
           "keep_router_state_through_metadata_inference"]


def moe_layers(model: nn.Module) -> Iterator[nn.Module]:
    """Every mixture-of-experts ``mlp`` (a ``MoELayer``) of ``model``, in module order."""
    from megatrain.models.common.moe.layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):
            yield module


def expert_grad_scale(dims: ParallelDims) -> float:
    """``f = edp / (dp x cp x t)``: what the experts' FSDP2 average over ``edp`` is multiplied by to give
    the sum over the token-distinct ranks divided by ``dp x cp`` (``t = tp`` without sequence
    parallelism, where the tensor-parallel ranks hold the same tokens, else 1)."""
    t = dims.tp if dims.tp > 1 and not dims.sequence_parallel else 1
    return dims.expert_data_parallel / (dims.dp * dims.cp * t)


def router_groups(dims: ParallelDims) -> tuple[Any, Any]:
    """(``reduce_group``, ``global_group``) of the routers of this rank's stage, or None where one
    rank holds all those tokens."""
    sequence_axes = ("cp", "tp") if dims.sequence_parallel else ("cp",)
    reduce_mesh = dims.flat_submesh(*sequence_axes)
    global_mesh = dims.flat_submesh("dp", *sequence_axes)
    return (reduce_mesh.get_group() if reduce_mesh is not None else None,
            global_mesh.get_group() if global_mesh is not None else None)


class RouterParallel(ParallelStyle):
    """The router under tensor parallelism: its weight a replicated DTensor on the ``tp`` mesh, its input
    (``x`` [b, s, h], this rank's sequence part under sequence parallelism) a DTensor ``Shard(1)``
    (sequence parallel) or ``Replicate``, so the logits' ``F.linear`` makes the weight's gradient the sum
    of the ranks' partial gradients; the router's outputs are plain tensors (the router computes on
    local logits). Buffers (the expert bias) stay plain."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.input_layout = Shard(1) if sequence_parallel else Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # By hand, not distribute_module: that would make the expert-bias buffer a DTensor as well.
        layout = self.input_layout
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(
                DTensor.from_local(param, device_mesh, [Replicate()], run_check=False),
                requires_grad=param.requires_grad))

        def prepare_input(mod: nn.Module, inputs: tuple) -> tuple:
            x, *rest = inputs
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [layout], run_check=False)
            return (x, *rest)

        def local_output(mod: nn.Module, inputs: tuple, outputs: Any) -> Any:
            if isinstance(outputs, DTensor):
                return outputs.to_local()
            if isinstance(outputs, (tuple, list)):
                return type(outputs)(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
            return outputs

        module.register_forward_pre_hook(prepare_input)
        module.register_forward_hook(local_output)
        return module


def apply_expert_parallel(model: nn.Module, dims: ParallelDims) -> bool:
    """Shard the experts of ``model`` (a model or pipeline stage on the meta device, tensor-parallel
    plan applied) over the ``ep`` mesh, give every MoE layer its dispatcher and router groups (see the
    module docstring). Returns whether the model has MoE layers; nothing changes in one process."""
    layers = list(moe_layers(model))
    if not layers:
        return False
    dims.validate_experts(model.config)
    if dims.world_size == 1:
        return True
    from megatrain.parallel.expert_dispatch import AllGatherDispatcher, AllToAllDispatcher, ScaledGradDispatcher

    scale = expert_grad_scale(dims)
    reduce_group, global_group = router_groups(dims)
    ep_mesh = dims.expert_mesh()["ep"] if dims.ep > 1 else None
    for layer in layers:
        layer.router.reduce_group, layer.router.global_group = reduce_group, global_group
        if dims.tp > 1:
            RouterParallel(dims.sequence_parallel)._apply(layer.router, dims.submesh("tp"))
        local = layer.dispatcher
        if ep_mesh is not None:
            for module in layer.experts.modules():
                for name, param in list(module.named_parameters(recurse=False)):
                    module.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)]),
                                                                 requires_grad=param.requires_grad))
            cls = AllToAllDispatcher if dims.moe_dispatcher == "alltoall" else AllGatherDispatcher
            layer.dispatcher = cls(local, ep_group=ep_mesh.get_group(), grad_scale=scale)
        elif scale != 1.0:
            layer.dispatcher = ScaledGradDispatcher(local, grad_scale=scale)
    return True


_ROUTER_STATE = ("logged", "local_tokens_per_expert", "global_tokens_per_expert", "global_steps")


def keep_router_state_through_metadata_inference(stage: Any, module: nn.Module) -> None:
    """Newer torch infers a stage's input and output metadata before the first step with a real forward
    and backward of one micro-batch (``PipelineStage._prepare_forward_infra`` ...
    ``_post_metadata_inference_cleanup``), which the mixture-of-experts routers would count as a
    micro-batch of the iteration (logged balancing losses, expert-bias and global_aux_loss token
    counts): their running state is put back as it was before it."""
    from megatrain.models.common.moe.router import moe_routers

    routers = moe_routers(module)
    cleanup = getattr(stage, "_post_metadata_inference_cleanup", None)
    if not routers or cleanup is None or not hasattr(stage, "_prepare_forward_infra"):
        return
    prepare = stage._prepare_forward_infra
    saved: list[list[dict[str, Any]]] = []

    def copy(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        return value.clone() if isinstance(value, torch.Tensor) else value

    def prepare_forward_infra(*args: Any, **kwargs: Any) -> Any:
        if not saved:
            saved.append([{name: copy(getattr(r, name)) for name in _ROUTER_STATE} for r in routers])
        return prepare(*args, **kwargs)

    def post_metadata_inference_cleanup(*args: Any, **kwargs: Any) -> Any:
        if saved:
            for router, state in zip(routers, saved.pop()):
                for name, value in state.items():
                    setattr(router, name, value)
        return cleanup(*args, **kwargs)

    stage._prepare_forward_infra = prepare_forward_infra
    stage._post_metadata_inference_cleanup = post_metadata_inference_cleanup
