"""Per-iteration host work of :meth:`StepMixin.queue_step`: the module tree is not walked each
iteration (``Module.train()``, ``Module.parameters()``) where nothing can have changed, and the
model still trains in training mode after evaluation switched it off."""

from __future__ import annotations

import os

import torch

from megatrain.training.arguments import parse_args
from megatrain.training.step import _has_fsdp_modules
from megatrain.training.trainer import Trainer

ARGS = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--num-workers", "0", "--lr", "1e-2", "--mock-data", "--hidden-dropout", "0.1",
        "--attention-dropout", "0.1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
        "--log-interval", "100", "--eval-iters", "1", "--train-iters", "4", "--bf16", "--no-torch-compile",
        "--device", "cpu", "--clip-grad", "1.0"]


def _trainer() -> Trainer:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    return Trainer(parse_args(ARGS))


def _step(t: Trainer) -> None:
    t.queue_step()
    t.state.iteration += 1
    t.settle()


def test_training_mode_is_set_once_and_again_after_evaluation():
    t = _trainer()
    try:
        for m in t.model.modules():  # a submodule left in eval mode before the first iteration
            if isinstance(m, torch.nn.Dropout):
                m.eval()
                break
        calls = []
        original = type(t.model).train

        def counting_train(self, mode=True):
            if self is t.model and mode:  # eval() is train(False)
                calls.append(mode)
            return original(self, mode)

        type(t.model).train = counting_train
        try:
            _step(t)
            assert calls == [True] and all(m.training for m in t.model.modules())
            _step(t)
            assert calls == [True]  # already training: the module tree is not walked again
            t.model.eval()  # what evaluation does (it switches back itself; a caller may not)
            _step(t)
            assert calls == [True, True] and all(m.training for m in t.model.modules())
        finally:
            type(t.model).train = original
    finally:
        t.close()


def test_parameters_are_read_once_in_module_order():
    t = _trainer()
    try:
        assert not _has_fsdp_modules(t.module)
        _step(t)
        cached = t._module_parameters()
        assert isinstance(cached, list) and cached is t._module_parameters()
        assert [id(p) for p in cached] == [id(p) for p in t.module.parameters()]
    finally:
        t.close()


def test_same_weights_as_walking_the_module_tree_each_iteration():
    """The cached calls train exactly like Module.train() and Module.parameters() every iteration."""
    cached, walking = _trainer(), _trainer()
    try:
        walking._train_mode = lambda: walking.model.train()  # type: ignore[method-assign]
        walking._module_parameters = lambda: walking.module.parameters()  # type: ignore[method-assign]
        for t in (cached, walking):
            torch.manual_seed(1)
            for i in range(4):
                _step(t)
                if i == 1:
                    t.model.eval()
        for a, b in zip(cached.module.parameters(), walking.module.parameters(), strict=True):
            assert torch.equal(a, b)
        assert cached.last_result == walking.last_result
    finally:
        cached.close()
        walking.close()
