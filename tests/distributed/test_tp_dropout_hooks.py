"""The per-TP-rank RNG fork is installed only where there is dropout: without dropout the compiled
layers must not be split by the fork's hooks (a graph break per layer made TP runs slow on GPUs)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel
from megatrain.parallel.tensor_parallel import apply_tensor_parallel


@pytest.fixture()
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


@pytest.mark.parametrize("dropout,hooked", [(0.0, False), (0.1, True)])
def test_fork_hooks_follow_dropout(one_rank_group, dropout, hooked):
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128,
                    max_position_embeddings=16, hidden_dropout=dropout, attention_dropout=dropout)
    with torch.device("meta"):
        model = GPTModel(cfg)
    apply_tensor_parallel(model, one_rank_group, sequence_parallel=True)
    for layer in model.layers.values():
        assert bool(layer.self_attention.core_attention._forward_pre_hooks) == hooked
        assert bool(layer.dropout._forward_pre_hooks) == hooked
