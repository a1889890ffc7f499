"""A checkpoint saved by a TP=2 job exports, in one process, to a Hugging Face model with the same logits."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from dist_harness import SEED, full_parameters, run_workers, tiny_config

from megatrain.models.gpt import GPTModel
from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import TrainState

transformers = pytest.importorskip("transformers")


def _save_tp2(rank: int, world_size: int, root: str, style: str) -> dict:
    import torch.distributed as dist

    from megatrain.parallel.data_parallel import DataParallelConfig
    from megatrain.parallel.dims import ParallelDims
    from megatrain.parallel.parallelize import ParallelizeConfig, parallelize_model

    config = tiny_config(style)
    dims = ParallelDims(dist.get_world_size(), tp=2)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = GPTModel(config)
    model = parallelize_model(model, dims, ParallelizeConfig(DataParallelConfig()), device=torch.device("cpu"),
                            seed=SEED).model
    with torch.no_grad():  # make norms and biases non-trivial too (same change on both ranks)
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(0.01 * (torch.arange(local.numel(), dtype=local.dtype).reshape(local.shape) % 7))
    checkpointing.save_checkpoint(os.path.join(root, style), TrainState(iteration=2), model, None, {},
                                  argparse.Namespace(), config)
    return full_parameters(model)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_tp2_checkpoint_exports_with_same_logits(style, tmp_path):
    from megatrain.convert.export_hf import export_checkpoint
    from megatrain.inference.generation import generate
    from megatrain.inference.loading import load_model

    params = run_workers(_save_tp2, 2, str(tmp_path), style)[0]
    reference = GPTModel(tiny_config(style)).eval()
    reference.load_state_dict(params)
    export_checkpoint(str(tmp_path / style), str(tmp_path / "hf"), progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (reference(tokens) - hf(tokens).logits).abs().max().item() < 1e-4
    # tools/generate.py's loader reads the TP=2 checkpoint into one process; greedy tokens match HF's.
    model, _ = load_model(str(tmp_path / style), torch.device("cpu"))
    with torch.no_grad():
        theirs = hf.generate(tokens[:, :8], attention_mask=torch.ones_like(tokens[:, :8]), max_new_tokens=6,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(model, tokens[:, :8].tolist(), 6) == theirs[:, 8:].tolist()
