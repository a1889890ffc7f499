"""--dist-ckpt-strictness on real checkpoints of megatrain's own saver (one process): a model tensor the
checkpoint lacks (Megatron's "unexpected" key) and a checkpoint tensor the model lacks (Megatron's
"missing" key), under every mode: refused in one line naming the flag and the keys, named in one line
per kind and loaded around (the model's keeping its values and starting with a fresh optimizer state),
or loaded around silently; the default refuses both, --finetune keeps its own rule under it."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import CheckpointError, TrainState
from megatrain.checkpoint.strictness import STRICTNESS_MODES, handling, name_keys
from megatrain.models.gpt import GPTModel
from megatrain.models.gpt.config import GPTConfig
from megatrain.optimizer import OptimizerConfig, build_optimizer

CONFIG = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, max_position_embeddings=8,
                   hidden_dropout=0.0, attention_dropout=0.0)


def _model(extra: bool = False, seed: int = 1) -> GPTModel:
    """The GPT model; ``extra``: with one more parameter, as a model of a later version might have."""
    model = GPTModel(CONFIG)
    model.init_weights(seed)
    if extra:
        model.register_parameter("extra_scale", torch.nn.Parameter(torch.full((4,), 3.0)))
    return model


def _step(model: GPTModel, opt: torch.optim.Optimizer) -> None:
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, labels=tokens).mean() + (model.extra_scale.sum() if hasattr(model, "extra_scale") else 0)
    loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two checkpoints after one AdamW step: of the plain model, and of the model with an extra tensor."""
    out = {}
    for name, extra in (("plain", False), ("extra", True)):
        model = _model(extra)
        opt = build_optimizer(model, OptimizerConfig(lr=1e-2))
        _step(model, opt)
        root = tmp_path_factory.mktemp(name)
        path = checkpointing.save_checkpoint(str(root), TrainState(iteration=1), model, opt, {},
                                             argparse.Namespace(), CONFIG)
        out[name] = (path, {k: v.clone() for k, v in model.state_dict().items()},
                     {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()})
    return out


def _load(path: str, model: GPTModel, strictness: str, *, finetune: bool = False, optim: bool = True):
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2)) if optim else None
    checkpointing.load_checkpoint(path, model, opt, load_optim=optim, load_rng=False, model_config=CONFIG,
                                  finetune=finetune, strictness=strictness)
    return opt


def _refusal(path: str, model: GPTModel, strictness: str, **kw) -> str:
    with pytest.raises(CheckpointError) as e:
        _load(path, model, strictness, **kw)
    message = str(e.value)
    assert "\n" not in message and f"--dist-ckpt-strictness {strictness}" in message
    return message


def test_modes_are_megatrons():
    assert set(STRICTNESS_MODES) == {"assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                                     "raise_all", "return_unexpected", "return_all", "ignore_all"}
    assert handling("assume_ok_unexpected") == ("raise", "raise")  # megatrain's loader refuses both, as before
    assert handling("raise_unexpected") == ("raise", "ignore")  # Megatron's torch_dist default
    assert name_keys([f"k{i}" for i in range(11)]) == "k0, k1, k2, k3, k4, k5, k6, k7 and 3 more"


@pytest.mark.parametrize("strictness", ["assume_ok_unexpected", "raise_unexpected", "raise_all"])
def test_a_model_tensor_the_checkpoint_lacks_is_refused(saved, strictness):
    path = saved["plain"][0]
    message = _refusal(path, _model(extra=True), strictness)
    assert (f"checkpoint {path} lacks 1 tensor the model has (Megatron's \"unexpected\" keys): extra_scale "
            "(--dist-ckpt-strictness log_unexpected loads the rest, leaving these at their initial values)") in message


@pytest.mark.parametrize("strictness", ["log_unexpected", "log_all", "return_unexpected", "return_all",
                                        "ignore_all"])
def test_a_model_tensor_the_checkpoint_lacks_keeps_its_value_and_starts_its_optimizer_fresh(
        saved, strictness, capsys):
    path, weights, states = saved["plain"]
    model = _model(extra=True, seed=5)
    opt = _load(path, model, strictness)
    assert torch.equal(model.extra_scale, torch.full((4,), 3.0))  # its initial value
    for name, value in model.state_dict().items():
        if name != "extra_scale":
            assert torch.equal(value, weights[name]), name
    params = dict(model.named_parameters())
    assert model.extra_scale not in opt.state  # fresh: Adam sets it up at the next step
    for name, state in states.items():
        assert all(torch.equal(opt.state[params[name]][k], v) for k, v in state.items()), name
    _step(model, opt)  # the fresh state starts at step 1
    assert opt.state[model.extra_scale]["step"].item() == 1
    assert opt.state[params["embedding.word_embeddings.weight"]]["step"].item() == 2
    out = capsys.readouterr().out
    if strictness == "ignore_all":
        assert "WARNING" not in out
    else:
        assert out.count("\n") == 1 and out.startswith(f"WARNING: --dist-ckpt-strictness {strictness}: ")
        assert (f"lacks 1 tensor the model has (Megatron's \"unexpected\" keys): extra_scale; they keep their "
                "initial values and start with a fresh optimizer state") in out


@pytest.mark.parametrize("strictness", ["assume_ok_unexpected", "raise_all"])
def test_a_checkpoint_tensor_the_model_lacks_is_refused(saved, strictness):
    path = saved["extra"][0]
    message = _refusal(path, _model(), strictness)
    assert (f"checkpoint {path} holds 1 tensor the model does not have (Megatron's \"missing\" keys): extra_scale "
            "(--dist-ckpt-strictness raise_unexpected (Megatron's default behaviour) leaves them unread)") in message
    if strictness == "assume_ok_unexpected":
        assert message.startswith("--dist-ckpt-strictness assume_ok_unexpected (the default): ")


@pytest.mark.parametrize("strictness", ["raise_unexpected", "log_unexpected", "log_all", "return_unexpected",
                                        "ignore_all"])
def test_a_checkpoint_tensor_the_model_lacks_stays_unread(saved, strictness, capsys):
    path, weights, states = saved["extra"]
    model = _model()
    opt = _load(path, model, strictness)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    params = dict(model.named_parameters())
    assert all(torch.equal(opt.state[params[n]]["exp_avg"], s["exp_avg"]) for n, s in states.items() if n in params)
    out = capsys.readouterr().out
    if strictness == "log_all":
        assert out.count("\n") == 1 and out.startswith("WARNING: --dist-ckpt-strictness log_all: ")
        assert "holds 1 tensor the model does not have (Megatron's \"missing\" keys): extra_scale; they are not " \
               "loaded" in out
    else:
        assert "WARNING" not in out


def test_both_kinds_at_once_and_the_finetune_rules(saved, capsys):
    """A checkpoint of another model: raise_all names both kinds in its one line; --finetune under the default
    loads around both with its own warning, and under an explicit mode follows the mode."""
    path = saved["plain"][0]
    other = GPTConfig(**{**CONFIG.__dict__, "untie_embeddings_and_output_weights": True})

    def model():
        m = GPTModel(other)
        m.register_parameter("extra_scale", torch.nn.Parameter(torch.ones(2)))
        return m

    def load(strictness, finetune=True):
        checkpointing.load_checkpoint(path, model(), None, load_optim=False, load_rng=False, model_config=other,
                                      finetune=finetune, strictness=strictness)

    with pytest.raises(CheckpointError, match="--untie-embeddings-and-output-weights"):  # config differences first
        load("ignore_all", finetune=False)
    capsys.readouterr()
    load("assume_ok_unexpected")
    out = capsys.readouterr().out
    assert "--finetune: 2 tensors keep their initial values (not in the checkpoint: extra_scale, output_layer.weight)" \
        in out
    with pytest.raises(CheckpointError) as e:
        load("raise_all")
    assert "lacks 2 tensors the model has (Megatron's \"unexpected\" keys): extra_scale, output_layer.weight " \
           "(--dist-ckpt-strictness log_unexpected" in str(e.value)
    capsys.readouterr()
    load("log_unexpected")
    out = capsys.readouterr().out
    assert "--dist-ckpt-strictness log_unexpected: " in out and "output_layer.weight" in out
    load("ignore_all")
    assert "extra_scale" not in capsys.readouterr().out.replace("--finetune: the model differs", "")


def test_many_keys_are_abbreviated(saved):
    path = saved["plain"][0]
    model = _model()
    for i in range(12):
        model.register_buffer(f"new_{i:02d}", torch.zeros(1))
    message = _refusal(path, model, "raise_unexpected")
    assert "lacks 12 tensors the model has" in message and "new_07 and 4 more" in message
