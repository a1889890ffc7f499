"""--ckpt-step, --finetune, --no-load-optim, --no-load-rng, --dist-ckpt-strictness with the real trainer (one
process, mock data)."""

from __future__ import annotations

import os

import pytest
import torch

from megatrain.training.arguments import parse_args
from megatrain.training.trainer import Trainer

ARGS = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--num-workers", "0", "--lr", "1e-2", "--lr-warmup-iters", "1", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "60", "--log-interval", "100", "--eval-iters", "0",
        "--device", "cpu", "--train-iters", "4"]


def _trainer(*extra: str) -> Trainer:
    return Trainer(parse_args([*ARGS, *extra]))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    save = str(tmp_path_factory.mktemp("ckpt"))
    t = _trainer("--save", save, "--save-interval", "2")
    t.train()
    t.close()
    weights = {k: v.clone() for k, v in t.module.state_dict().items()}
    return save, weights, t.scheduler.state_dict()


def _same_weights(t: Trainer, weights) -> bool:
    return all(torch.equal(v, weights[k]) for k, v in t.module.state_dict().items())


def test_default_load_restores_everything(saved):
    save, weights, sched = saved
    t = _trainer("--load", save)
    assert t.state.iteration == 4 and t.state.consumed_train_samples == 16
    assert _same_weights(t, weights) and t.optimizer.state and t.scheduler.state_dict() == sched
    rng = torch.load(os.path.join(save, "iter_0000004", "rng_rank00000.pt"), weights_only=True)
    assert torch.equal(torch.get_rng_state(), rng["torch"])


def test_ckpt_step_loads_that_iteration(saved):
    save, weights, _ = saved
    t = _trainer("--load", save, "--ckpt-step", "2")
    assert t.state.iteration == 2 and t.state.consumed_train_samples == 8
    assert not _same_weights(t, weights)
    with pytest.raises(SystemExit, match="--ckpt-step 3"):
        _trainer("--load", save, "--ckpt-step", "3")


def test_finetune_loads_weights_only(saved):
    save, weights, sched = saved
    t = _trainer("--load", save, "--finetune")
    assert t.state.iteration == 0 and t.state.consumed_train_samples == 0
    assert _same_weights(t, weights) and not t.optimizer.state
    assert t.scheduler.state_dict() != sched  # the schedule starts again from the flags


def test_no_load_optim_keeps_iteration_but_not_optimizer_or_schedule(saved):
    save, weights, sched = saved
    t = _trainer("--load", save, "--no-load-optim")
    assert t.state.iteration == 4 and _same_weights(t, weights)
    assert not t.optimizer.state and t.scheduler.state_dict() != sched


def test_no_load_rng_keeps_the_seeded_generators(saved):
    save, _, _ = saved
    rng = torch.load(os.path.join(save, "iter_0000004", "rng_rank00000.pt"), weights_only=True)
    t = _trainer("--load", save, "--no-load-rng")
    assert t.state.iteration == 4 and not torch.equal(torch.get_rng_state(), rng["torch"])


def test_dist_ckpt_strictness_reaches_the_load(saved, capsys):
    """--finetune of the tied checkpoint into an untied model: the output layer is not in the checkpoint.
    raise_unexpected stops the run in one line naming the flag and the key; log_all names it and trains
    on with the output layer's initial values."""
    save, weights, _ = saved
    untied = ["--load", save, "--finetune", "--untie-embeddings-and-output-weights"]
    with pytest.raises(SystemExit) as e:
        _trainer(*untied, "--dist-ckpt-strictness", "raise_unexpected")
    message = str(e.value)
    assert message.startswith(f"error: --load {save}: --dist-ckpt-strictness raise_unexpected: checkpoint ")
    assert "\n" not in message and "lacks 1 tensor the model has (Megatron's \"unexpected\" keys): output_layer.weight" \
        in message
    capsys.readouterr()
    t = _trainer(*untied, "--dist-ckpt-strictness", "log_all")
    out = capsys.readouterr().out
    assert "WARNING: --dist-ckpt-strictness log_all: checkpoint " in out
    assert "(Megatron's \"unexpected\" keys): output_layer.weight; they keep their initial values" in out
    assert torch.equal(t.module.embedding.word_embeddings.weight, weights["embedding.word_embeddings.weight"])
    t.close()
