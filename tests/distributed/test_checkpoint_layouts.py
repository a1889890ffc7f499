"""A checkpoint saved by a parallel layout (TP=2, ZeRO-3) loads into one process, and back.

DCP stores DTensor / FSDP2 shards with their global shapes, so model weights and AdamW state come
back whole in a plain model; a single-process checkpoint loads into a TP=2 model.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from dist_harness import SEED, full_parameters, global_batch, micro_loss, make_optimizer, run_workers, tiny_config

from megatrain.models.gpt import GPTModel, canonical_parameter_name
from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import TrainState

CONFIG = tiny_config("llama")  # untied output layer, GQA, SwiGLU


def _layout_model(tp: int, zero: int):
    import torch.distributed as dist

    from megatrain.parallel.data_parallel import DataParallelConfig
    from megatrain.parallel.dims import ParallelDims
    from megatrain.parallel.parallelize import ParallelizeConfig, parallelize_model

    dims = ParallelDims(dist.get_world_size(), tp=tp)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = GPTModel(CONFIG)
    return parallelize_model(model, dims, ParallelizeConfig(DataParallelConfig(zero_stage=zero)),
                           device=torch.device("cpu"), seed=SEED).model


def _optimizer_state(model, opt) -> dict[str, torch.Tensor]:
    names = {id(p): canonical_parameter_name(n) for n, p in model.named_parameters()}
    out = {}
    for p, state in opt.state.items():
        t = state["exp_avg"]
        out[names[id(p)]] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def _step(model, opt) -> None:
    tokens, labels, mask = global_batch(0)
    opt.zero_grad()
    micro_loss(model, tokens, labels, mask).backward()
    opt.step()


def _save_and_load(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for name, tp, zero in (("tp2", 2, 0), ("zero3", 1, 3)):
        model = _layout_model(tp, zero)
        opt = make_optimizer(model)
        _step(model, opt)
        checkpointing.save_checkpoint(os.path.join(root, name), TrainState(iteration=1), model, opt, {},
                                      argparse.Namespace(), CONFIG)
        out[name] = {"params": full_parameters(model), "exp_avg": _optimizer_state(model, opt)}
    # The other direction: a single-process checkpoint (written by the parent) into TP=2.
    model = _layout_model(2, 0)
    opt = make_optimizer(model)
    _step(model, opt)  # creates optimizer state to load into
    checkpointing.load_checkpoint(checkpointing.find_checkpoint(os.path.join(root, "single")), model, opt)
    out["into_tp2"] = {"params": full_parameters(model), "exp_avg": _optimizer_state(model, opt)}
    return out


def _plain_trained() -> tuple[GPTModel, torch.optim.Optimizer]:
    model = GPTModel(CONFIG)
    model.init_weights(SEED + 1)
    opt = make_optimizer(model)
    _step(model, opt)
    _step(model, opt)
    return model, opt


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


@pytest.mark.slow
def test_checkpoints_move_between_layouts(tmp_path):
    single_model, single_opt = _plain_trained()
    checkpointing.save_checkpoint(str(tmp_path / "single"), TrainState(iteration=2), single_model, single_opt, {},
                                  argparse.Namespace(), CONFIG)
    results = run_workers(_save_and_load, 2, str(tmp_path))
    for name in ("tp2", "zero3"):
        model = GPTModel(CONFIG)
        opt = make_optimizer(model)
        _step(model, opt)
        meta = checkpointing.load_checkpoint(checkpointing.find_checkpoint(str(tmp_path / name)), model, opt)
        assert meta["train_state"]["iteration"] == 1 and meta["world_size"] == 2
        _assert_same(full_parameters(model), results[0][name]["params"])
        _assert_same(_optimizer_state(model, opt), results[0][name]["exp_avg"])
    for per_rank in results:
        _assert_same(per_rank["into_tp2"]["params"], full_parameters(single_model))
        _assert_same(per_rank["into_tp2"]["exp_avg"], _optimizer_state(single_model, single_opt))
