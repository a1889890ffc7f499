"""Context parallelism (``--context-parallel-size c``): the sequence of every sample split over ``c`` ranks.

Layout (Megatron's load balancing for causal attention): the sequence is cut into ``2c`` equal
chunks and context-parallel rank ``r`` holds chunks ``r`` and ``2c - 1 - r``, so every rank has the
same amount of attention work. :func:`split_batch` cuts a micro-batch's tokens, labels, loss mask
and position ids that way; the position ids keep their global values, so rotary and learned
position embeddings see the true positions.

Attention gathers the keys and values of the whole sequence from the ``cp`` group before the
softmax (an all-gather whose backward is a reduce-scatter, through PyTorch's functional
collectives), puts them back in sequence order, and masks causally by global position; queries
stay local. A sliding window (``--window-size``) is applied in global positions too: the hook hands
``core_attention`` its queries' positions, against which it lays the window over the whole
sequence's keys. Everything else in a layer works on local tokens only. It is installed as a forward
pre-hook on each layer's ``core_attention``, so the model code is unchanged.

The context-parallel ranks of one data-parallel rank read the same samples; gradients are
reduced over data x context parallel ranks together (each rank's loss is its tokens' share of the
micro-batch's loss, scaled by ``c`` against the averaging over the ``c`` ranks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from megatrain.models.common.layer_stacks import transformer_layers

__all__ = ["chunk_positions", "split_batch", "apply_context_parallel"]


def chunk_positions(seq_length: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions (ascending) of the tokens context-parallel ``rank`` of ``cp`` holds."""
    if seq_length % (2 * cp):
        raise ValueError(f"--seq-length ({seq_length}) must be divisible by 2 x --context-parallel-size ({cp})")
    chunk = seq_length // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def split_batch(batch: Any, cp: int, rank: int) -> Any:
    """This rank's part of a typed micro-batch (its sequence fields' positions :func:`chunk_positions`)."""
    index = chunk_positions(batch.seq_length, cp, rank, getattr(batch, batch.sequence_fields[0]).device)
    return batch.context_parallel_part(index)


def _gather_autograd(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    out = gather(x, dim, group)
    return funcol.wait_tensor(out) if hasattr(funcol, "wait_tensor") else out


class _SequenceGather:
    """Forward pre-hook of ``core_attention``: local queries, keys and values of the whole sequence."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.group = cp_mesh.get_group()
        self._cache: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _layout(self, local_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(order: gathered rank-major position -> sequence order, causal mask [1, 1, local, full],
        this rank's global positions [local])."""
        key = (local_len, device)
        if key not in self._cache:
            full = local_len * self.cp
            gathered = torch.cat([chunk_positions(full, self.cp, r, device) for r in range(self.cp)])
            order = torch.argsort(gathered)
            mine = chunk_positions(full, self.cp, self.rank, device)
            mask = torch.arange(full, device=device)[None, :] <= mine[:, None]
            self._cache[key] = (order, mask[None, None], mine)
        return self._cache[key]

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        q, k, v, attention_mask, past = args
        if attention_mask is not None or past:
            raise ValueError("context parallelism runs causal attention over whole sequences only "
                             "(no explicit masks, no KV cache)")
        order, mask, mine = self._layout(k.shape[2], k.device)
        k = _gather_autograd(k.contiguous(), 2, self.group).index_select(2, order)
        v = _gather_autograd(v.contiguous(), 2, self.group).index_select(2, order)
        return (q, k, v, mask, 0), {**kwargs, "query_positions": mine}


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Install the key/value gather on every transformer layer's ``core_attention`` (in place)."""
    hook = _SequenceGather(cp_mesh)
    for layer in transformer_layers(model):
        layer.self_attention.core_attention.register_forward_pre_hook(hook, with_kwargs=True)
    return model
