"""Surviving crashes: kill -9 of one rank in a `torchrun` job, then the same command again, reaches
the same final loss as an uninterrupted run; SIGTERM with --async-save leaves a loadable checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from megatrain import checkpoint as checkpointing
from megatrain.training.logging import parse_train_log_line
from tests.e2e.conftest import REPO, cpu_env, run_and_signal, run_cmd

ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--num-workers", "0", "--lr", "1e-3",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--log-interval", "1",
        "--eval-iters", "0", "--device", "cpu"]
ITERS = 30


def _train_lines(stdout: str) -> list[dict]:
    return [parse_train_log_line(l) for l in stdout.splitlines() if "] iteration " in l]


def _job(save: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
            "pretrain_gpt.py", *ARGS, "--train-iters", str(ITERS), "--save", save, "--save-interval", "2",
            "--load", save]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find the worker processes")
def test_kill_9_of_one_rank_then_relaunch_reaches_the_same_loss(tmp_path):
    reference = _train_lines(run_cmd(_job(str(tmp_path / "ref")), env=cpu_env()).stdout)
    assert reference[-1]["iteration"] == ITERS

    save = str(tmp_path / "ckpt")
    cmd = _job(save)
    proc = subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed_at = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # once a checkpoint exists and training goes on, kill rank 1
            if "] iteration " in line and parse_train_log_line(line)["iteration"] >= 7:
                killed_at = parse_train_log_line(line)["iteration"]
                workers = {_rank_of(p): p for p in _children(proc.pid)}
                os.kill(workers[1], signal.SIGKILL)
                break
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed_at is not None and killed_at < ITERS, "the job ended before the kill"
    assert proc.returncode != 0
    saved = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    assert 4 <= saved < ITERS

    resumed = run_cmd(cmd, env=cpu_env()).stdout  # the very same command
    assert f"loaded checkpoint from {checkpointing.checkpoint_dir(save, saved)}" in resumed
    lines = _train_lines(resumed)
    assert lines[0]["iteration"] == saved + 1 and lines[-1]["iteration"] == ITERS
    by_iter = {d["iteration"]: d for d in reference}
    for d in lines:  # bit for bit: model, optimizer, schedule, data position and every rank's RNG came back
        assert d["lm loss"] == by_iter[d["iteration"]]["lm loss"], d
    assert not [n for n in os.listdir(save) if n.endswith(".tmp")]


# ~14 s; tests/faults/test_kill_during_save.py's SIGTERM case with --async-save (every iteration saved, so a
# background write is under way) exits cleanly, leaves nothing half-written and resumes bit for bit
@pytest.mark.long
def test_sigterm_with_async_save_leaves_a_loadable_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    single = [a for a in ARGS if a != "cpu" and a != "--device"]
    proc = run_and_signal([sys.executable, "pretrain_gpt.py", *single, "--train-iters", "100000",
                           "--exit-signal-handler", "--async-save", "--save", str(save), "--save-interval", "3"],
                          when="in the background (training loop blocked", env=cpu_env())  # an async save began
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, err
    assert "received SIGTERM" in out
    iteration = int((save / "latest_checkpointed_iteration.txt").read_text())
    ckpt = checkpointing.checkpoint_dir(str(save), iteration)
    assert checkpointing.checkpoint_problem(ckpt) is None
    assert f"written in the background to {ckpt}" in out  # the exit waited for the background write
    resumed = run_cmd([sys.executable, "pretrain_gpt.py", *single, "--train-iters", str(iteration + 1),
                       "--override-opt_param-scheduler", "--load", str(save)])  # a shorter run: the flags' schedule
    assert [d["iteration"] for d in _train_lines(resumed.stdout)] == [iteration + 1]
