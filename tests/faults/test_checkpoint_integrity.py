"""Checkpoint faults with the real `pretrain_gpt.py`: a byte changed in place in each file kind of
a checkpoint, NaN weights, the committed checkpoints of formats 2 and 3 (training continues
exactly), one of another model family, two runs sharing one --save (started together and apart, a
killed holder), and a disk that fills up during a save (a small tmpfs mounted in a user namespace). Each asserts one clear line, no traceback, and nothing lost.

The processes of a test run concurrently where they are independent, to keep the file short.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import integrity
from tests.e2e.conftest import REPO, cpu_env

TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--log-interval", "1", "--eval-iters", "0",
        "--device", "cpu", "--lr", "1e-3", "--num-workers", "0"]
# The model of tests/data/checkpoint_format2 (see tests/data/README.md).
FORMAT2_MODEL = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
                 "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", "2",
                 "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32",
                 "--make-vocab-size-divisible-by", "8", "--log-interval", "1", "--eval-iters", "0", "--device",
                 "cpu", "--lr", "1e-3", "--seed", "1234"]
FORMAT2 = REPO / "tests" / "data" / "checkpoint_format2"


def _pretrain(*flags: str) -> list[str]:
    return [sys.executable, "pretrain_gpt.py", *flags]


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    """Start ``argv`` from the repository root, stdout and stderr into ``log``.out / ``log``.err."""
    return subprocess.Popen(argv, cwd=REPO, env=cpu_env(), stdout=open(f"{log}.out", "w"),
                            stderr=open(f"{log}.err", "w"), text=True)


def _wait(proc: subprocess.Popen, log: Path, timeout: float = 120) -> tuple[int, str, str]:
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, Path(f"{log}.out").read_text(), Path(f"{log}.err").read_text()


def _run_all(jobs: dict[str, list[str]], root: Path) -> dict[str, tuple[int, str, str]]:
    procs = {name: _start(argv, root / name) for name, argv in jobs.items()}
    return {name: _wait(proc, root / name) for name, proc in procs.items()}


def _one_error_line(rc: int, out: str, err: str) -> str:
    assert rc != 0, out[-2000:]
    assert "Traceback" not in out + err, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


def _iterations(out: str) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"\] iteration +(\d+)/", out)]


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and text in path.read_text():
            return
        assert proc.poll() is None, f"exited early: {path.read_text()[-2000:]}"
        time.sleep(0.05)
    raise AssertionError(f"{text!r} did not appear in {path}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A --save directory with the checkpoints of iterations 1 and 2 (model, optimizer, RNG)."""
    root = tmp_path_factory.mktemp("saved")
    rc, out, err = _wait(_start(_pretrain(*TINY, "--train-iters", "2", "--save", str(root / "ckpt"),
                                          "--save-interval", "1"), root / "log"), root / "log")
    assert rc == 0, err
    return root / "ckpt"


def _change_one_byte(path: Path) -> None:
    """In place, same size: a digit of a value in the JSON files (still valid JSON), else the middle byte."""
    data = bytearray(path.read_bytes())
    if path.suffix == ".json":
        at = re.search(rb'"iteration": (\d)', data).start(1) if path.name.startswith("complete_") else \
            re.search(rb'"saved_at": "\d\d\d(\d)', data).start(1)
        data[at] = ord("0") + (data[at] - ord("0") + 1) % 10
    else:
        data[len(data) // 2] ^= 0x5A
    with open(path, "r+b") as f:
        f.write(data)


KINDS = {"shard": "__0_0.distcp", "dcp-metadata": ".metadata", "meta": "meta.json", "rng": "rng_rank00000.pt",
         "marker": "complete_rank00000.json"}


def test_a_byte_changed_in_any_checkpoint_file_is_one_line_on_load(saved, tmp_path):
    jobs = {}
    for kind, name in KINDS.items():
        copy = tmp_path / kind
        shutil.copytree(saved, copy)
        _change_one_byte(copy / "iter_0000002" / name)
        jobs[kind] = _pretrain(*TINY, "--train-iters", "3", "--override-opt_param-scheduler", "--load", str(copy), "--ckpt-step", "2")
    jobs["search"] = _pretrain(*TINY, "--train-iters", "3", "--override-opt_param-scheduler", "--load", str(tmp_path / "shard"))
    results = _run_all(jobs, tmp_path)
    for kind, name in KINDS.items():
        line = _one_error_line(*results[kind])
        assert line.startswith("error: --ckpt-step 2: ") and name in line, line
    rc, out, err = results["search"]  # the newest does not check out: a warning, then the one before
    assert rc == 0, err
    warning = [l for l in out.splitlines() if l.startswith("WARNING: checkpoint")]
    assert len(warning) == 1 and "iter_0000002" in warning[0] and "__0_0.distcp is damaged" in warning[0]
    assert f"loaded checkpoint from {tmp_path / 'shard' / 'iter_0000001'} at iteration 1" in out
    assert _iterations(out) == [2, 3]


def test_nan_weights_are_refused_and_a_nan_validation_loss_has_nan_ppl(saved, tmp_path):
    import torch

    from megatrain.models.gpt.config import GPTConfig
    from megatrain.models.gpt import GPTModel

    src = str(saved / "iter_0000002")
    meta = checkpointing.read_meta(src)
    model = GPTModel(GPTConfig(**meta["model_config"]))
    checkpointing.load_checkpoint(src, model, None, load_optim=False, load_rng=False)
    with torch.no_grad():
        dict(model.named_parameters())["layers.0.mlp.linear_fc1.weight"][0, 0] = float("nan")
    checkpointing.save_checkpoint(str(tmp_path / "nan"), checkpointing.TrainState(**meta["train_state"]), model, None,
                                  {"scheduler": meta["scheduler"]}, argparse.Namespace(), model.config,
                                  save_optim=False)
    at = TINY.index("--eval-iters")
    evaluate = TINY[:at] + TINY[at + 2:]
    results = _run_all({
        "refused": _pretrain(*TINY, "--train-iters", "3", "--override-opt_param-scheduler", "--load", str(tmp_path / "nan")),
        "allowed": _pretrain(*evaluate, "--train-iters", "3", "--override-opt_param-scheduler", "--load", str(tmp_path / "nan"), "--skip-train",
                             "--eval-iters", "1", "--allow-non-finite-checkpoint")}, tmp_path)
    line = _one_error_line(*results["refused"])
    assert "NaN/Inf values in 1 tensor " in line and "model.layers.0.mlp.linear_fc1.weight" in line
    rc, out, err = results["allowed"]
    assert rc == 0, err
    assert "lm loss value: NAN | lm loss PPL: NAN |" in out  # not exp(20)


# The model of tests/data/checkpoint_format3, and the losses of iterations 3 and 4 of the run it was
# saved from (commit 341c4db; see tests/data/README.md).
FORMAT3_MODEL = [*FORMAT2_MODEL, "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                 "--ffn-hidden-size", "16", "--disable-bias-linear"]
FORMAT3 = REPO / "tests" / "data" / "checkpoint_format3"
FORMAT3_LOSSES = ["3.689199E+00", "3.704996E+00"]
# What commit 341c4db printed resuming from tests/data/checkpoint_format2 as below (no optimizer state in it).
FORMAT2_LOSSES = ["3.685901E+00", "3.696728E+00"]


def _losses(out: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"\] iteration +(\d+)/.*?\| lm loss: ([^ ]+) \|", out)}


def test_checkpoints_of_formats_2_and_3_load_and_training_continues_exactly(tmp_path):
    results = _run_all({
        "format2": _pretrain(*FORMAT2_MODEL, "--train-iters", "4", "--override-opt_param-scheduler", "--load",
                             str(FORMAT2), "--save", str(tmp_path / "new2")),
        "format3": _pretrain(*FORMAT3_MODEL, "--train-iters", "4", "--load", str(FORMAT3),
                             "--save", str(tmp_path / "new3")),
        "uninterrupted": _pretrain(*FORMAT3_MODEL, "--train-iters", "4")}, tmp_path)
    for name, path in (("format2", FORMAT2), ("format3", FORMAT3)):
        rc, out, err = results[name]
        assert rc == 0, err
        assert f"loaded checkpoint from {path / 'iter_0000002'} at iteration 2" in out
        assert _iterations(out) == [3, 4]
        meta = checkpointing.read_meta(str(tmp_path / f"new{name[-1]}" / "iter_0000004"))
        assert meta["format_version"] == 4 and meta["family"] == "gpt"
        assert not (path / ".megatrain.lock").exists()  # --load alone takes no lock
    # Against the committed figures (printed by another machine): one unit in the last printed place,
    # as the golden-loss gate allows, since CPUs of other vector widths round float32 sums differently.
    # (The committed checkpoints' first two iterations ran on that other machine too.)
    def close(got: dict[int, str], want: list[str]) -> bool:
        return [float(v) for v in got.values()] == pytest.approx([float(v) for v in want], rel=2e-6)

    assert close(_losses(results["format2"][1]), FORMAT2_LOSSES)
    assert close(_losses(results["format3"][1]), FORMAT3_LOSSES)
    uninterrupted = _losses(results["uninterrupted"][1])
    assert close(uninterrupted, ["3.692139E+00", "3.698542E+00", *FORMAT3_LOSSES])
    assert close(_losses(results["format3"][1]), [uninterrupted[3], uninterrupted[4]])


def test_a_checkpoint_of_another_model_family_is_refused_in_one_line(tmp_path):
    """The format-3 checkpoint made a format-4 one of the (made-up) family "bert"; its markers rewritten."""
    ckpt = tmp_path / "bert" / "iter_0000002"
    shutil.copytree(FORMAT3 / "iter_0000002", ckpt)
    (tmp_path / "bert" / checkpointing.TRACKER).write_text("2\n")
    meta = json.loads((ckpt / "meta.json").read_text())
    meta.update(format_version=4, family="bert")
    (ckpt / "meta.json").write_text(json.dumps(meta))
    names = [n for n in os.listdir(ckpt) if not n.startswith("complete_rank")]
    (ckpt / "complete_rank00000.json").write_text(integrity.marker_text(str(ckpt), 0, 1, 2, names))
    assert checkpointing.checkpoint_problem(str(ckpt), verify=True) is None
    rc, out, err = _wait(_start(_pretrain(*FORMAT3_MODEL, "--train-iters", "4", "--load", str(tmp_path / "bert")),
                                tmp_path / "log"), tmp_path / "log")
    line = _one_error_line(rc, out, err)
    assert line == (f"error: --load {tmp_path / 'bert'}: checkpoint {ckpt} holds a model of the family 'bert' and "
                    f"the flags build one of the family 'gpt' (a checkpoint loads only into a model of its own family)")


# Long runs with data loader workers (forked while the --save lock is held).
LONG = [*TINY, "--train-iters", "100000", "--log-interval", "10", "--save-interval", "50", "--exit-signal-handler",
        "--num-workers", "1"]


def test_two_runs_started_together_on_one_save_one_is_refused(tmp_path):
    save = tmp_path / "ckpt"
    procs = [_start(_pretrain(*LONG, "--save", str(save)), tmp_path / f"run{i}") for i in range(2)]
    try:
        deadline = time.time() + 60
        while all(p.poll() is None for p in procs) and time.time() < deadline:
            time.sleep(0.05)
        refused = next(i for i, p in enumerate(procs) if p.poll() is not None)
        winner = procs[1 - refused]
        _wait_for(tmp_path / f"run{1 - refused}.out", "] iteration       10/", winner)
        winner.send_signal(signal.SIGTERM)  # saves and exits cleanly
    finally:
        for p in procs:
            if p.poll() is None and p.wait(timeout=60) is None:
                p.kill()
    line = _one_error_line(*_wait(procs[refused], tmp_path / f"run{refused}"))
    assert f"--save {save} is in use by pid {winner.pid} on host" in line
    rc, out, err = _wait(winner, tmp_path / f"run{1 - refused}")
    assert rc == 0 and "received SIGTERM" in out, err
    assert not (save / ".megatrain.lock").exists()  # released at exit
    assert checkpointing.find_checkpoint(str(save)) is not None


def test_a_second_run_is_refused_while_the_first_lives_and_a_killed_runs_lock_is_taken_over(tmp_path):
    save = tmp_path / "ckpt"
    first = _start(_pretrain(*LONG, "--save", str(save)), tmp_path / "first")
    try:
        _wait_for(tmp_path / "first.out", "saved checkpoint at iteration      50", first)
        rc, out, err = _wait(_start(_pretrain(*TINY, "--train-iters", "60", "--save", str(save),
                                             "--override-opt_param-scheduler", "--load", str(save)),
                                    tmp_path / "second"), tmp_path / "second")
        line = _one_error_line(rc, out, err)
        assert f"--save {save} is in use by pid {first.pid} on host" in line and "lock file" in line
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    assert (save / ".megatrain.lock").exists()  # left by the killed run, its flock gone with it
    fd, stray = tempfile.mkstemp(prefix=checkpointing.TRACKER + ".", suffix=".tmp", dir=save)  # as atomic_path names
    os.close(fd)
    (save / "notes.tmp").write_text("not ours\n")
    last = int((save / checkpointing.TRACKER).read_text())
    rc, out, err = _wait(_start(_pretrain(*TINY, "--train-iters", str(last + 2), "--save", str(save),
                                          "--override-opt_param-scheduler", "--load", str(save)), tmp_path / "third"), tmp_path / "third")
    assert rc == 0, err
    assert f"taking over the lock of a run that ended without releasing it (pid {first.pid}" in out
    removed = next(l for l in out.splitlines() if "removed what an interrupted run left: " in l)
    assert os.path.basename(stray) in removed.split(": ")[-1].split(", ")
    assert not os.path.exists(stray) and (save / "notes.tmp").exists()
    assert _iterations(out) == [last + 1, last + 2] and (save / checkpointing.TRACKER).read_text() == f"{last + 2}\n"
    assert not (save / ".megatrain.lock").exists()


def _can_mount_tmpfs(where: Path) -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            f"mount -t tmpfs -o size=1m tmpfs {where}"], capture_output=True)
    return probe.returncode == 0


CHECK_AFTER = """
import json, os, sys
from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import integrity
save = sys.argv[1]
print(json.dumps({"names": sorted(os.listdir(save)), "tracker": open(os.path.join(save, checkpointing.TRACKER)).read(),
                  "problem": checkpointing.checkpoint_problem(checkpointing.checkpoint_dir(save, 1), verify=True)}))
"""


def test_disk_full_during_a_save_is_one_line_and_keeps_the_earlier_checkpoint(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if not _can_mount_tmpfs(mnt):
        pytest.skip("cannot mount a tmpfs in a user namespace here")
    save = mnt / "ckpt"
    # One checkpoint of this model takes ~640 KB: the first save fits in 1 MB, the second does not.
    train = " ".join(_pretrain(*TINY, "--train-iters", "3", "--save", str(save), "--save-interval", "1"))
    script = (f"mount -t tmpfs -o size=1m tmpfs {mnt} && {{ {train} > {tmp_path}/run.out 2> {tmp_path}/run.err; "
              f"echo $? > {tmp_path}/rc; {sys.executable} -c '{CHECK_AFTER}' {save}; }}")
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], cwd=REPO,
                          env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rc = int((tmp_path / "rc").read_text())
    line = _one_error_line(rc, (tmp_path / "run.out").read_text(), (tmp_path / "run.err").read_text())
    assert line.startswith(f"error: --save {save}: cannot write the checkpoint of iteration 2: No space left on "
                           f"device"), line
    after = json.loads(proc.stdout.strip().splitlines()[-1])
    assert after["names"] == ["iter_0000001", checkpointing.TRACKER]  # no iter_0000002.tmp, no lock file
    assert after["tracker"] == "1\n" and after["problem"] is None
