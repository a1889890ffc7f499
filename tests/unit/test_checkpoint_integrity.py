"""Checkpoint integrity on one process: block checksums, strict completeness markers, verification
on load with the fallback rules, format-2 checkpoints, NaN/Inf refusal, the --save lock and its
clean-up of leftover temporaries, one-line save failures, and the validation line of a NaN loss."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import pytest
import torch

from megatrain.checkpoint import integrity, save_lock
from megatrain.locking import acquire
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel
from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import CheckpointError, TrainState
from megatrain.training.logging import format_validation_line, parse_validation_line, validation_ppl
from tests.unit.test_checkpointing import CONFIG, _trained

FORMAT2 = Path(__file__).resolve().parents[1] / "data" / "checkpoint_format2"


def _save(root, it, model, opt, **kw):
    return checkpointing.save_checkpoint(str(root), TrainState(iteration=it), model, opt, {}, argparse.Namespace(),
                                         model.config, **kw)


def _flip(path: str, offset: int | None = None) -> None:
    """Change one byte in place (same size)."""
    with open(path, "r+b") as f:
        size = os.path.getsize(path)
        f.seek(size // 2 if offset is None else offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))


# ---------------------------------------------------------------------------------------------- checksums

def test_block_checksums_are_crc32_of_each_block_computed_in_parallel(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "BLOCK", 1000)  # several blocks per file without writing 64 MiB ones
    data = {f"f{i}": os.urandom(2500 + i) for i in range(3)}
    for name, blob in data.items():
        (tmp_path / name).write_bytes(blob)
    (tmp_path / "empty").write_bytes(b"")
    got = integrity.compute_checksums(str(tmp_path), [*data, "empty"], threads=3)
    for name, blob in data.items():
        assert got[name] == " ".join(f"{zlib.crc32(blob[i:i + 1000]):08x}" for i in range(0, len(blob), 1000))
    assert got["empty"] == f"{zlib.crc32(b''):08x}"
    assert integrity.compute_checksums(str(tmp_path), data, threads=1) == {n: got[n] for n in data}


def test_marker_round_trip_and_a_changed_block_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "BLOCK", 1000)
    (tmp_path / "a.distcp").write_bytes(os.urandom(3000))
    (tmp_path / "b.pt").write_bytes(os.urandom(10))
    (tmp_path / integrity.marker_name(1)).write_text(
        integrity.marker_text(str(tmp_path), 1, 2, 7, ["a.distcp", "b.pt"]))
    marker = integrity.read_marker(str(tmp_path), 1)
    assert (marker.rank, marker.world_size, marker.iteration) == (1, 2, 7)
    assert marker.files == {"a.distcp": 3000, "b.pt": 10} and len(marker.checksums["a.distcp"].split()) == 3
    assert integrity.size_problem(str(tmp_path), marker) is None
    assert integrity.checksum_problem(str(tmp_path), [marker]) is None
    _flip(str(tmp_path / "a.distcp"), 1500)
    problem = integrity.checksum_problem(str(tmp_path), [marker])
    assert problem.startswith("a.distcp is damaged") and "bytes 1000-1999" in problem and "\n" not in problem


@pytest.mark.parametrize("edit, why", [
    (lambda m: "{not json", "not JSON"),
    (lambda m: "[1, 2]", "not a JSON object"),
    (lambda m: {**m, "files": list(m["files"])}, "'files'"),
    (lambda m: {**m, "files": {**m["files"], "x.pt": "12"}}, "'files'"),
    (lambda m: {**m, "files": {"../../etc/passwd": 1}}, "'files'"),
    (lambda m: {**m, "rank": True}, "'rank'"),
    (lambda m: {**m, "rank": 3}, "rank 3"),
    (lambda m: {**m, "extra": 1}, "unknown field 'extra'"),
    (lambda m: {**m, "checksum": "md5"}, "unknown checksum scheme"),
    (lambda m: {**m, "checksums": {}}, "'checksums'"),
    (lambda m: {**m, "iteration": m["iteration"] + 1}, "own checksum"),
    (lambda m: {k: v for k, v in m.items() if k != "marker_crc32"}, "own checksum"),
])
def test_an_edited_marker_is_one_line_naming_it(tmp_path, edit, why):
    (tmp_path / "x.pt").write_bytes(b"12345")
    path = tmp_path / integrity.marker_name(0)
    path.write_text(integrity.marker_text(str(tmp_path), 0, 1, 5, ["x.pt"]))
    edited = edit(json.loads(path.read_text()))
    path.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(integrity.MarkerError) as e:
        integrity.read_marker(str(tmp_path), 0)
    assert str(e.value).startswith("complete_rank00000.json is not a valid completeness marker")
    assert why in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- on load

@pytest.fixture
def two_checkpoints(tmp_path):
    model, opt = _trained()
    _save(tmp_path, 2, model, opt)
    newest = _save(tmp_path, 4, model, opt)
    return tmp_path, newest


def _file_of_kind(ckpt: str, kind: str) -> str:
    names = {"shard": next(n for n in os.listdir(ckpt) if n.endswith(".distcp")), "metadata": ".metadata",
             "meta": "meta.json", "rng": "rng_rank00000.pt", "marker": "complete_rank00000.json"}
    return os.path.join(ckpt, names[kind])


def test_saved_markers_hold_checksums_of_every_file(two_checkpoints):
    _, newest = two_checkpoints
    assert checkpointing.read_meta(newest)["format_version"] == 4
    marker = integrity.read_marker(newest, 0)
    assert set(marker.checksums) == set(marker.files) == {n for n in os.listdir(newest)
                                                           if not n.startswith("complete_rank")}
    assert checkpointing.checkpoint_problem(newest, verify=True) is None


@pytest.mark.parametrize("kind", ["shard", "metadata", "meta", "rng", "marker"])
def test_a_changed_file_falls_back_with_a_warning_and_is_refused_when_named(two_checkpoints, capsys, kind):
    root, newest = two_checkpoints
    path = _file_of_kind(newest, kind)
    if kind == "meta":  # a digit of a value: still valid JSON, only the checksum can tell
        text = Path(path).read_text()
        at = text.index('"saved_at": "') + len('"saved_at": "') + 3
        Path(path).write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:])
    elif kind == "marker":  # a digit of the iteration number
        text = Path(path).read_text()
        at = text.index('"iteration": ') + len('"iteration": ')
        Path(path).write_text(text[:at] + "5" + text[at + 1:])
    else:
        _flip(path)
    name = os.path.basename(path)
    assert checkpointing.checkpoint_problem(newest) is None or kind == "marker"  # sizes are unchanged
    assert name in checkpointing.checkpoint_problem(newest, verify=True)
    assert checkpointing.find_checkpoint(str(root)) == str(root / "iter_0000002")
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("WARNING: checkpoint") and name in out[0] and "falling back" in out[0]
    for named in ({"load": str(root), "step": 4}, {"load": newest, "step": None}):
        with pytest.raises(SystemExit) as e:
            checkpointing.find_checkpoint(named["load"], named["step"])
        assert name in str(e.value) and "\n" not in str(e.value)
    if kind != "marker":
        assert checkpointing.find_checkpoint(str(root), 4, verify=False) == newest


def test_a_format_2_checkpoint_still_loads(tmp_path):
    ckpt = checkpointing.find_checkpoint(str(FORMAT2))
    assert ckpt == str(FORMAT2 / "iter_0000002")
    assert checkpointing.read_meta(ckpt)["format_version"] == 2
    assert integrity.read_marker(ckpt, 0).checksums is None
    meta = checkpointing.read_meta(ckpt)
    model = GPTModel(GPTConfig(**meta["model_config"]))
    checkpointing.load_checkpoint(ckpt, model, None, load_optim=False, load_rng=False)
    # a format 3 checkpoint whose marker lost its checksums is not taken for a format 2 one
    copy = tmp_path / "iter_0000002"
    shutil.copytree(ckpt, copy)
    meta["format_version"] = 3
    (copy / "meta.json").write_text(json.dumps(meta))
    marker = json.loads((copy / "complete_rank00000.json").read_text())
    marker["files"]["meta.json"] = os.path.getsize(copy / "meta.json")
    (copy / "complete_rank00000.json").write_text(json.dumps(marker))
    assert "holds no checksums" in checkpointing.checkpoint_problem(str(copy))


def test_non_finite_values_are_refused_on_load_unless_allowed(tmp_path, capsys):
    model, opt = _trained()
    with torch.no_grad():
        model.embedding.word_embeddings.weight[3, 1] = float("nan")
    opt.state[next(iter(opt.state))]["exp_avg"].view(-1)[0] = float("inf")
    ckpt = _save(tmp_path, 1, model, opt)
    fresh, fresh_opt = _trained(seed=2)
    with pytest.raises(CheckpointError) as e:
        checkpointing.load_checkpoint(ckpt, fresh, fresh_opt)
    message = str(e.value)
    assert "\n" not in message and "NaN/Inf values in 2 tensors" in message
    assert "--allow-non-finite-checkpoint" in message
    assert "model.embedding.word_embeddings.weight" in message and "exp_avg" in message
    checkpointing.load_checkpoint(ckpt, fresh, fresh_opt, allow_non_finite=True)
    assert torch.isnan(fresh.embedding.word_embeddings.weight[3, 1])
    assert "NaN/Inf values in 2 tensors" in capsys.readouterr().out
    assert integrity.non_finite_tensors({"a": torch.ones(2), "b": [torch.tensor([1, 2])], "c": torch.empty(0)}) == []


def test_validation_line_of_a_nan_loss_says_nan():
    assert math.isnan(validation_ppl(float("nan")))
    assert validation_ppl(30.0) == math.exp(20) and validation_ppl(1.0) == math.exp(1.0)
    line = format_validation_line(5, float("nan"))
    assert "lm loss PPL: NAN" in line
    assert math.isnan(parse_validation_line(line)["lm loss PPL"])


# ---------------------------------------------------------------------------------------------- saving

def test_a_failing_save_is_one_line_and_leaves_the_earlier_checkpoint(tmp_path):
    model, opt = _trained()
    _save(tmp_path, 2, model, opt)
    (tmp_path / "iter_0000004.tmp").write_text("a file where the save's directory goes\n")
    with pytest.raises(checkpointing.CheckpointSaveError) as e:
        _save(tmp_path, 4, model, opt)
    assert "\n" not in str(e.value) and f"--save {tmp_path}" in str(e.value) and "Not a directory" in str(e.value)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    assert checkpointing.find_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000002")


# ---------------------------------------------------------------------------------------------- the lock

def test_save_lock_refuses_a_second_holder_and_is_taken_over_when_stale(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    lock = save_lock.take_save_lock(save)
    assert os.path.isfile(os.path.join(save, save_lock.LOCK_NAME))
    with pytest.raises(SystemExit) as e:
        save_lock.take_save_lock(save)
    assert f"--save {save} is in use by pid {os.getpid()}" in str(e.value) and "\n" not in str(e.value)
    lock.release()
    assert not os.path.exists(os.path.join(save, save_lock.LOCK_NAME))
    # a holder that died: its file (with its details) is left, its flock gone
    dead = acquire(os.path.join(save, save_lock.LOCK_NAME), "x")
    os.close(dead.fd)
    again = save_lock.take_save_lock(save)
    assert "taking over the lock of a run that ended" in capsys.readouterr().out
    again.release()


def test_only_our_leftover_temporaries_are_removed_and_only_by_the_holder(tmp_path, capsys):
    save = tmp_path / "ckpt"
    save.mkdir()
    fd, stray = tempfile.mkstemp(prefix=checkpointing.TRACKER + ".", suffix=".tmp", dir=save)  # atomic_path's names
    os.close(fd)
    (save / "iter_0000004.tmp").mkdir()
    (save / "iter_0000002.deleting").mkdir()
    keep = ["latest_checkpointed_iteration.txt.mine.tmp", "notes.tmp", "iter_0000003.old", "x.txt.abcdefgh.tmp",
            checkpointing.TRACKER]
    for name in keep:
        (save / name).write_text("someone else's\n")
    assert save_lock.leftover_names(str(save)) == sorted([os.path.basename(stray), "iter_0000002.deleting",
                                                          "iter_0000004.tmp"])
    held = acquire(save / save_lock.LOCK_NAME, "another run")
    with pytest.raises(SystemExit):
        save_lock.take_save_lock(str(save))
    assert os.path.exists(stray)  # the holder may be writing it
    held.release()
    lock = save_lock.take_save_lock(str(save))
    assert "removed what an interrupted run left" in capsys.readouterr().out
    assert sorted(os.listdir(save)) == sorted([*keep, save_lock.LOCK_NAME])
    lock.release()


def test_the_hf_import_locks_its_save_directory(tmp_path):
    from megatrain.convert.export_hf import export_checkpoint
    from megatrain.convert.import_hf import import_hf_model

    model = GPTModel(CONFIG)
    model.init_weights(3)
    checkpointing.save_checkpoint(str(tmp_path / "ckpt"), TrainState(iteration=1), model, None, {},
                                  argparse.Namespace(), CONFIG, save_optim=False)
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "hf"), progress=False)
    dst = tmp_path / "imported"
    dst.mkdir()
    held = acquire(dst / save_lock.LOCK_NAME, "a training run")
    with pytest.raises(SystemExit) as e:
        import_hf_model(str(tmp_path / "hf"), str(dst), make_vocab_size_divisible_by=8)
    held.release()
    assert f"--save {dst} is in use by pid {os.getpid()}" in str(e.value)
    assert os.listdir(dst) == []  # nothing was written
    import_hf_model(str(tmp_path / "hf"), str(dst), make_vocab_size_divisible_by=8)
    assert checkpointing.find_checkpoint(str(dst)) == str(dst / "iter_0000000")
    assert not (dst / save_lock.LOCK_NAME).exists()
