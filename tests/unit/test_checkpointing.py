"""Checkpoint files on one process: completeness markers, fallback past broken checkpoints,
retention, async save, shape checks, --finetune subsets and the refusal of unsafe pickles."""

from __future__ import annotations

import argparse
import json
import os
import pickle

import pytest
import torch

from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel
from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import Checkpointer, CheckpointError, TrainState
from megatrain.optimizer import OptimizerConfig, build_optimizer

CONFIG = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, max_position_embeddings=8,
                   hidden_dropout=0.0, attention_dropout=0.0)


def _trained(config: GPTConfig = CONFIG, seed: int = 1):
    model = GPTModel(config)
    model.init_weights(seed)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2))
    tokens = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(tokens, labels=tokens).mean().backward()
    opt.step()
    return model, opt


def _save(root, it, model, opt, **kw):
    return checkpointing.save_checkpoint(str(root), TrainState(iteration=it, consumed_train_samples=4 * it), model,
                                         opt, {"scheduler": {"num_steps": it}}, argparse.Namespace(), model.config,
                                         **kw)


def _shards(ckpt: str) -> list[str]:
    return sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp"))


def test_markers_written_and_tracker_names_complete_checkpoint(tmp_path):
    model, opt = _trained()
    path = _save(tmp_path, 3, model, opt)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    marker = json.loads((tmp_path / "iter_0000003" / "complete_rank00000.json").read_text())
    assert set(marker["files"]) >= {"meta.json", ".metadata", "rng_rank00000.pt", *_shards(path)}
    assert checkpointing.checkpoint_problem(path) is None
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    meta = checkpointing.read_meta(path)
    assert meta["layout"]["world_size"] == 1 and meta["train_state"]["consumed_train_samples"] == 12


@pytest.mark.parametrize("damage", ["truncate_shard", "drop_metadata", "drop_marker", "drop_meta_json"])
def test_broken_newest_checkpoint_falls_back_with_warning(tmp_path, capsys, damage):
    model, opt = _trained()
    _save(tmp_path, 2, model, opt)
    newest = _save(tmp_path, 4, model, opt)
    if damage == "truncate_shard":
        shard = os.path.join(newest, _shards(newest)[0])
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    elif damage == "drop_metadata":
        os.remove(os.path.join(newest, ".metadata"))
    elif damage == "drop_marker":
        os.remove(os.path.join(newest, "complete_rank00000.json"))
    else:
        os.remove(os.path.join(newest, "meta.json"))
    assert checkpointing.checkpoint_problem(newest) is not None
    found = checkpointing.find_checkpoint(str(tmp_path))
    assert found == str(tmp_path / "iter_0000002")
    out = capsys.readouterr().out
    assert "WARNING" in out and "iter_0000004" in out and "falling back" in out
    with pytest.raises(SystemExit, match="--ckpt-step 4"):
        checkpointing.find_checkpoint(str(tmp_path), step=4)


def test_leftover_tmp_and_missing_tracker(tmp_path, capsys):
    model, opt = _trained()
    _save(tmp_path, 2, model, opt)
    (tmp_path / "iter_0000004.tmp").mkdir()  # a save killed half way
    assert checkpointing.find_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000002")
    os.remove(tmp_path / "latest_checkpointed_iteration.txt")  # killed between rename and tracker update
    assert checkpointing.find_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000002")
    assert "no latest_checkpointed_iteration.txt" in capsys.readouterr().out
    _save(tmp_path, 6, model, opt)
    assert not (tmp_path / "iter_0000004.tmp").exists()  # stale temporary directories are cleaned up
    assert checkpointing.find_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000006")


def test_nothing_complete_is_an_error(tmp_path):
    model, opt = _trained()
    path = _save(tmp_path, 2, model, opt)
    os.remove(os.path.join(path, ".metadata"))
    with pytest.raises(SystemExit, match="no complete checkpoint"):
        checkpointing.find_checkpoint(str(tmp_path))


def test_retention_keeps_last_k_complete_and_never_the_newest_complete(tmp_path):
    model, opt = _trained()
    for it in (1, 2, 3):
        _save(tmp_path, it, model, opt, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
    # A broken newer directory (say, copied in by hand) does not count as one of the K.
    broken = tmp_path / "iter_0000009"
    broken.mkdir()
    _save(tmp_path, 4, model, opt, keep_last=1)
    names = sorted(os.listdir(tmp_path))
    assert names == ["iter_0000004", "iter_0000009", "latest_checkpointed_iteration.txt"]
    assert checkpointing.find_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000004")
    with pytest.raises(ValueError, match="at least 1"):
        Checkpointer(keep_last=0)


def test_async_save_snapshots_state_and_matches_sync(tmp_path):
    model, opt = _trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    saver = Checkpointer(async_save=True, verbose=False)
    report = saver.save(str(tmp_path / "a"), TrainState(iteration=5), model, opt, {}, argparse.Namespace(), CONFIG)
    assert report.asynchronous and report.blocked_s >= 0
    with torch.no_grad():  # training goes on while the files are written
        for p in model.parameters():
            p.add_(1.0)
    saver.close()
    assert saver.last_write_s is not None
    assert checkpointing.checkpoint_problem(report.path) is None
    assert (tmp_path / "a" / "latest_checkpointed_iteration.txt").read_text() == "5\n"
    fresh = GPTModel(CONFIG)
    checkpointing.load_checkpoint(report.path, fresh, None, load_optim=False, load_rng=False)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_optimizer_and_rng_round_trip_and_no_save_flags(tmp_path, capsys):
    model, opt = _trained()
    torch.manual_seed(77)
    rng_at_save = torch.get_rng_state()
    path = _save(tmp_path / "full", 1, model, opt)
    torch.manual_seed(5)
    model2, opt2 = _trained(seed=2)
    checkpointing.load_checkpoint(path, model2, opt2, model_config=CONFIG)
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
    # --no-save-optim / --no-save-rng: neither is in the checkpoint; loading warns and keeps the fresh optimizer.
    bare = _save(tmp_path / "bare", 1, model, opt, save_optim=False, save_rng=False)
    keys = checkpointing.read_dcp_metadata(bare).state_dict_metadata
    assert keys and not [k for k in keys if k.startswith("optimizer")]
    assert not [n for n in os.listdir(bare) if n.startswith("rng_")]
    model3 = GPTModel(CONFIG)
    opt3 = build_optimizer(model3, OptimizerConfig(lr=1e-2))
    meta = checkpointing.load_checkpoint(bare, model3, opt3)
    assert not meta["has_optimizer"] and not opt3.state
    assert "no optimizer state" in capsys.readouterr().out


def test_shape_mismatch_lists_differences_and_finetune_loads_compatible_subset(tmp_path):
    model, opt = _trained()
    path = _save(tmp_path, 1, model, opt)
    wider = GPTConfig(**{**CONFIG.__dict__, "hidden_size": 32, "kv_channels": None})
    with pytest.raises(CheckpointError) as e:
        checkpointing.load_checkpoint(path, GPTModel(wider), None, model_config=wider)
    msg = str(e.value)
    assert "--hidden-size: checkpoint 16, flags 32" in msg and "embedding.word_embeddings.weight" in msg
    with pytest.raises(CheckpointError, match="shape differs"):  # --finetune does not hide shape differences
        checkpointing.load_checkpoint(path, GPTModel(wider), None, model_config=wider, finetune=True)
    untied = GPTConfig(**{**CONFIG.__dict__, "untie_embeddings_and_output_weights": True})
    with pytest.raises(CheckpointError, match="not in the checkpoint: output_layer.weight"):
        checkpointing.load_checkpoint(path, GPTModel(untied), None, model_config=untied, load_optim=False)
    target = GPTModel(untied)
    target.init_weights(9)
    before = target.output_layer.weight.detach().clone()
    checkpointing.load_checkpoint(path, target, None, model_config=untied, finetune=True, load_rng=False)
    assert torch.equal(target.embedding.word_embeddings.weight, model.embedding.word_embeddings.weight)
    assert torch.equal(target.output_layer.weight, before)  # not in the checkpoint: keeps its value


def test_config_differences_with_the_same_shapes_are_refused_one_line_each(tmp_path, capsys):
    """Other heads over the same hidden size (same tensor shapes) or another norm epsilon change
    the model's numbers: refused, every difference named; --finetune warns; dropout and the
    initialisation may differ."""
    model, opt = _trained()
    path = _save(tmp_path, 1, model, opt)
    other = GPTConfig(**{**CONFIG.__dict__, "num_attention_heads": 4, "kv_channels": None, "num_query_groups": None,
                         "norm_epsilon": 1e-6})
    with pytest.raises(CheckpointError) as e:
        checkpointing.load_checkpoint(path, GPTModel(other), opt, model_config=other)
    lines = str(e.value).splitlines()
    assert lines[1:5] == ["  --num-attention-heads: checkpoint 2, flags 4", "  --kv-channels: checkpoint 8, flags 4",
                          "  --num-query-groups: checkpoint 2, flags 4", "  --norm-epsilon: checkpoint 1e-05, flags 1e-06"]
    assert len(lines) == 6 and "--use-checkpoint-args" in lines[5] and "shape differs" not in str(e.value)
    target = GPTModel(other)
    checkpointing.load_checkpoint(path, target, None, model_config=other, finetune=True, load_rng=False)
    assert "--finetune: the model differs" in capsys.readouterr().out
    assert torch.equal(target.embedding.word_embeddings.weight, model.embedding.word_embeddings.weight)
    free = GPTConfig(**{**CONFIG.__dict__, "hidden_dropout": 0.3, "attention_dropout": 0.2, "init_method_std": 0.5,
                        "fp32_residual_connection": True})
    checkpointing.load_checkpoint(path, GPTModel(free), None, model_config=free, load_rng=False)


def test_config_differences_field_by_field():
    rope = GPTConfig(**{**CONFIG.__dict__, "position_embedding_type": "rope"})
    saved = dict(rope.__dict__)

    def diff(**changes):
        return checkpointing.config_differences(saved, GPTConfig(**{**rope.__dict__, **changes}))

    assert diff(rotary_base=500000.0) == ["--rotary-base: checkpoint 10000.0, flags 500000.0"]
    assert diff(rotary_percent=0.5) == ["--rotary-percent: checkpoint 1.0, flags 0.5"]
    assert diff(max_position_embeddings=4096) == []  # no position table with RoPE
    assert diff(add_bias_linear=False) == ["--disable-bias-linear: checkpoint without, flags with"]
    assert diff(swiglu=True, ffn_hidden_size=64) == ["--swiglu: checkpoint without, flags with"]
    assert diff(apply_layernorm_1p=True)[0].startswith("--apply-layernorm-1p: checkpoint without, flags with")
    assert diff(normalization="RMSNorm") == ["--normalization: checkpoint LayerNorm, flags RMSNorm"]
    assert diff(add_qkv_bias=True) == ["--add-qkv-bias: checkpoint without, flags with"]
    assert diff(qk_layernorm=True) == ["--qk-layernorm: checkpoint without, flags with"]
    assert diff(window_size=(7, 0)) == ["--window-size: checkpoint None, flags (7, 0)"]
    windowed = {**saved, "window_size": [7, 0]}  # as meta.json holds it
    assert checkpointing.config_differences(windowed, GPTConfig(**{**rope.__dict__, "window_size": (7, 0)})) == []
    assert diff(gelu_approximation="tanh", hidden_dropout=0.5) == []  # a warning elsewhere; regularisation
    learned = dict(CONFIG.__dict__)
    assert checkpointing.config_differences(learned, GPTConfig(**{**CONFIG.__dict__, "rotary_base": 5.0})) == []
    assert checkpointing.config_differences(learned, GPTConfig(**{**CONFIG.__dict__, "max_position_embeddings": 16})) \
        == ["--max-position-embeddings: checkpoint 8, flags 16"]
    assert checkpointing.config_differences(learned, rope) == [
        "--position-embedding-type: checkpoint learned_absolute, flags rope"]
    # A field the checkpoint predates counts as its default; a checkpoint with no config is not compared.
    del learned["norm_epsilon"], learned["qk_layernorm"], learned["add_qkv_bias"], learned["window_size"]  # older checkpoints: defaults
    assert checkpointing.config_differences(learned, GPTConfig(**CONFIG.__dict__)) == []
    assert checkpointing.config_differences(learned, GPTConfig(**{**CONFIG.__dict__, "norm_epsilon": 1e-6})) == [
        "--norm-epsilon: checkpoint 1e-05, flags 1e-06"]
    assert checkpointing.config_differences({}, rope) == []


def test_every_model_config_field_has_a_comparison_decision_and_a_flag():
    """A new GPTConfig field must be placed in the GPT family's CONFIG_CHECKS; each compared one
    (but the padded vocabulary) is a flag's dest, so --use-checkpoint-args can take it from the
    checkpoint; a condition names a config field."""
    from dataclasses import fields

    from megatrain.models.gpt.checkpoint_compat import CONFIG_CHECKS
    from megatrain.models.registry import get_family
    from megatrain.training.arguments import CONFIG_FIELD_DESTS, build_parser

    assert get_family("gpt").config_checks is CONFIG_CHECKS
    names = {f.name for f in fields(GPTConfig)}
    assert set(CONFIG_CHECKS) == names
    assert {check.how for check in CONFIG_CHECKS.values()} == {"compare", "warn", "no"}
    parser = build_parser()
    dests = {a.dest for a in parser._actions}
    options = {o for a in parser._actions for o in a.option_strings}
    for name, check in CONFIG_CHECKS.items():
        assert check.flag in options, check.flag
        assert check.when is None or check.when[0] in names, name
        if check.how == "compare" and name != "vocab_size":
            assert CONFIG_FIELD_DESTS.get(name, name) in dests, name


class _Evil:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


def test_metadata_with_arbitrary_objects_is_refused(tmp_path):
    model, opt = _trained()
    path = _save(tmp_path, 1, model, opt)
    canary = tmp_path / "pwned"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Evil(str(canary)), f)
    with pytest.raises(CheckpointError, match="refusing"):
        checkpointing.load_checkpoint(path, GPTModel(CONFIG), None)
    assert not canary.exists()


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_data_position_is_redivided_over_a_new_data_parallel_size(dp):
    from megatrain.data.loader import PretrainingSampler

    consumed, micro, global_batch = 24, 2, 8  # saved after 3 iterations under any layout
    per_rank = [iter(PretrainingSampler(100, consumed, micro, r, dp)) for r in range(dp)]
    for step in range(2):  # each global batch is the next 8 samples, each exactly once
        seen = [i for _ in range(global_batch // (micro * dp)) for it in per_rank for i in next(it)]
        assert sorted(seen) == list(range(consumed + step * global_batch, consumed + (step + 1) * global_batch))
