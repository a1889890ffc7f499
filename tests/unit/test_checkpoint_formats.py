"""Checkpoint formats and model families: the committed checkpoints of formats 2 and 3 still load
(read as GPT checkpoints), a checkpoint now records its family (format 4), one of another family is
refused in one line, the comparison table and the defaults of fields a checkpoint predates come
from the family, and damaged or newer format fields are refused."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import CheckpointError, TrainState
from megatrain.checkpoint.info import checkpoint_info, format_info
from megatrain.checkpoint.safe_pickle import load_tensors_file
from megatrain.models import registry
from megatrain.models.common.config_checks import ConfigCheck
from megatrain.models.gpt import GPTModel
from megatrain.models.gpt.checkpoint_compat import CONFIG_CHECKS
from megatrain.models.gpt.config import GPTConfig
from megatrain.optimizer import OptimizerConfig, build_optimizer
from tests.unit.test_checkpointing import CONFIG, _trained

DATA = Path(__file__).resolve().parents[1] / "data"
FORMAT2, FORMAT3 = DATA / "checkpoint_format2", DATA / "checkpoint_format3"


@dataclass
class ToyConfig(GPTConfig):
    """A second family's config: GPT's fields, another default for one of them."""

    norm_epsilon: float = 1e-6


# The toy family compares fewer fields than GPT: norm_epsilon may differ.
TOY_CHECKS = {**CONFIG_CHECKS, "norm_epsilon": ConfigCheck("no", "--norm-epsilon")}


@pytest.fixture
def toy_family(monkeypatch):
    family = replace(registry.get_family("gpt"), name="toy", config_class=ToyConfig, config_checks=TOY_CHECKS)
    monkeypatch.setitem(registry._REGISTRY, "toy", family)  # registered for this test only
    return family


def _save(root, model, opt=None, it=1):
    return checkpointing.save_checkpoint(str(root), TrainState(iteration=it), model, opt, {}, argparse.Namespace(),
                                         model.config)


@pytest.mark.parametrize("path, version", [(FORMAT2, 2), (FORMAT3, 3)])
def test_checkpoints_of_formats_2_and_3_read_as_gpt_checkpoints_and_load(path, version):
    ckpt = checkpointing.find_checkpoint(str(path))
    assert ckpt == str(path / "iter_0000002")
    meta = checkpointing.read_meta(ckpt)
    assert meta["format_version"] == version and meta["family"] == registry.DEFAULT_FAMILY == "gpt"
    raw = json.loads((path / "iter_0000002" / "meta.json").read_text())
    assert "family" not in raw  # the reader supplies it
    config = checkpointing.checkpoint_model_config(ckpt, meta)
    assert type(config) is GPTConfig and config == GPTConfig(**raw["model_config"])
    model = GPTModel(config)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3))
    torch.manual_seed(0)
    checkpointing.load_checkpoint(ckpt, model, opt, model_config=config)
    assert meta["has_optimizer"] == (version == 3) and bool(opt.state) == (version == 3)
    assert torch.equal(torch.get_rng_state(), load_tensors_file(os.path.join(ckpt, "rng_rank00000.pt"))["torch"])
    info = checkpoint_info(str(path))
    assert info["family"] == "gpt" and info["format_version"] == version
    assert "model:             gpt, num_layers 1, hidden_size 8" in format_info(info)


def test_a_checkpoint_records_its_family_next_to_its_config(tmp_path, toy_family):
    model, opt = _trained()
    meta = checkpointing.read_meta(_save(tmp_path / "gpt", model, opt))
    assert meta["format_version"] == checkpointing.FORMAT_VERSION == 4
    assert meta["family"] == "gpt" and meta["model_config"]["hidden_size"] == CONFIG.hidden_size
    toy = ToyConfig(**CONFIG.__dict__)
    ckpt = _save(tmp_path / "toy", GPTModel(toy))
    meta = checkpointing.read_meta(ckpt)
    assert meta["family"] == "toy"
    assert type(checkpointing.checkpoint_model_config(ckpt, meta)) is ToyConfig


def test_a_checkpoint_of_another_family_is_refused_in_one_line(tmp_path, toy_family):
    model, opt = _trained()
    gpt_ckpt = _save(tmp_path / "gpt", model, opt)
    toy = ToyConfig(**CONFIG.__dict__)
    toy_ckpt = _save(tmp_path / "toy", GPTModel(toy))
    for ckpt, config, saved, built in [(gpt_ckpt, toy, "gpt", "toy"), (toy_ckpt, CONFIG, "toy", "gpt")]:
        for finetune in (False, True):  # the family is never negotiable
            with pytest.raises(CheckpointError) as e:
                checkpointing.load_checkpoint(ckpt, GPTModel(config), None, model_config=config, finetune=finetune)
            message = str(e.value)
            assert "\n" not in message
            assert f"holds a model of the family {saved!r} and the flags build one of the family {built!r}" in message
    # Without a run's config (inference, export) the model is built from the checkpoint's own family.
    checkpointing.load_checkpoint(toy_ckpt, GPTModel(toy), None, load_rng=False)


def test_an_unknown_family_is_named_when_the_model_is_built_from_the_checkpoint(tmp_path):
    model, _ = _trained()
    ckpt = _save(tmp_path, model)
    meta = checkpointing.read_meta(ckpt)
    meta["family"] = "no-such-family"
    with pytest.raises(CheckpointError, match="unknown model family 'no-such-family'"):
        checkpointing.checkpoint_model_config(ckpt, meta)


def test_the_comparison_table_and_the_old_defaults_are_the_familys(tmp_path, toy_family):
    toy = ToyConfig(**{**CONFIG.__dict__, "norm_epsilon": 1e-6})
    ckpt = _save(tmp_path, GPTModel(toy))
    other_epsilon = ToyConfig(**{**CONFIG.__dict__, "norm_epsilon": 1e-3})
    checkpointing.load_checkpoint(ckpt, GPTModel(other_epsilon), None, model_config=other_epsilon, load_rng=False)
    with pytest.raises(CheckpointError, match="--norm-epsilon: checkpoint 1e-06, flags 0.001"):  # GPT's table
        checkpointing.load_checkpoint(ckpt, GPTModel(other_epsilon), None, model_config=other_epsilon,
                                      config_checks=CONFIG_CHECKS)
    # A field the checkpoint predates counts as its family's default: 1e-6 for the toy, 1e-5 for GPT.
    saved = {k: v for k, v in CONFIG.__dict__.items() if k != "norm_epsilon"}
    flags = ToyConfig(**{**CONFIG.__dict__, "norm_epsilon": 1e-5})
    assert checkpointing.config_differences(saved, flags, CONFIG_CHECKS) == [
        "--norm-epsilon: checkpoint 1e-06, flags 1e-05"]
    assert checkpointing.config_differences(saved, flags, CONFIG_CHECKS, GPTConfig) == []
    assert checkpointing.config_differences(saved, GPTConfig(**CONFIG.__dict__)) == []


def _edit_meta(ckpt: str, **changes) -> None:
    path = os.path.join(ckpt, "meta.json")
    meta = json.loads(open(path).read())
    meta.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del meta[k]
    open(path, "w").write(json.dumps(meta))


@pytest.mark.parametrize("changes, problem", [
    ({"family": None}, "meta.json is damaged (format 4 names the model family; it has none)"),
    ({"family": 3}, "meta.json: 'family' must name a model family, not 3"),
    ({"format_version": 5}, "written by a newer megatrain (checkpoint format 5; this one reads formats up to 4)"),
])
def test_a_damaged_family_or_a_newer_format_is_refused(tmp_path, capsys, changes, problem):
    model, _ = _trained()
    _save(tmp_path, model, it=1)
    ckpt = _save(tmp_path, model, it=2)
    _edit_meta(ckpt, **changes)
    assert problem in checkpointing.checkpoint_problem(ckpt)
    assert checkpointing.find_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000001")
    assert "iter_0000002 is not usable" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--ckpt-step 2"):
        checkpointing.find_checkpoint(str(tmp_path), 2)


def test_the_checkpoint_package_imports_nothing_above_it():
    """megatrain.checkpoint (and the GPT family it reads through the registry) never imports the
    training, inference, conversion or parallel code (a family's objective builds its batches with
    megatrain.data.batch, which imports only the base modules)."""
    import subprocess
    import sys

    code = ("import pkgutil, sys, megatrain.checkpoint as c\n"
            "for m in pkgutil.iter_modules(c.__path__): __import__('megatrain.checkpoint.' + m.name)\n"
            "from megatrain.models.registry import get_family; get_family('gpt')\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('megatrain.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.split()
    assert "megatrain.checkpoint.info" in out and "megatrain.models.gpt.family" in out
    above = [m for m in out if m.split(".")[1] in ("training", "inference", "convert", "parallel")]
    assert [m for m in out if m.startswith("megatrain.data")] in ([], ["megatrain.data", "megatrain.data.batch"])
    assert above == []
