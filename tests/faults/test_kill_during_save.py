"""Signals at random moments of a checkpoint save, on real ``pretrain_gpt.py`` runs of a tiny model.

Every iteration is saved (``--save-interval 1``, ``--keep-last-checkpoints 2``), so most of a run's
time after start-up is spent saving: DCP writing shards, the RNG file, meta.json, the markers, the
rename, the tracker, retention. A run is signalled a seeded random delay (spread over the save
window its own earlier saves measured) after the log line of a save iteration, then the very same
command resumes it. Checked after every signal: the newest reported checkpoint and the tracker
still load, no file under a final name (the tracker, ``iter_XXXXXXX/``) is half-written; and every
logged ``lm loss`` of every run equals the uninterrupted run's exactly.

- SIGKILL, synchronous and ``--async-save``: a chain of ``MEGATRAIN_FAULT_KILLS`` kills per mode
  (default 4), each followed by a resume that is itself killed, the last one running to the end.
  ``MEGATRAIN_FAULT_SEED`` (default 0) picks the moments; a soak is e.g.
  ``MEGATRAIN_FAULT_KILLS=100 MEGATRAIN_FAULT_SEED=3 pytest tests/faults/test_kill_during_save.py``.
- SIGTERM with ``--exit-signal-handler`` (both modes): the run finishes the save, saves where it
  stopped, exits 0 with nothing temporary left, and resumes identically.
- SIGINT (Ctrl-C): nothing is lost and the resume is identical.

Also: Ctrl-C is reported in one line, and a retention deletion cut short by kill -9
(``iter_XXXXXXX.deleting``) is finished by the next run.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatrain import checkpoint as checkpointing
from tests.e2e.conftest import REPO, cpu_env, run_cmd
from tests.faults.conftest import fault_losses, fault_train_cmd

KILLS = int(os.environ.get("MEGATRAIN_FAULT_KILLS", "4"))
SEED = int(os.environ.get("MEGATRAIN_FAULT_SEED", "0"))
ITERS = 6 * KILLS + 6  # each killed run gets at most 6 iterations past its start: room for all of them

_SAVED = re.compile(r"^ saved checkpoint at iteration\s+(\d+) to \S+ \(([\d.]+) ms\)$")
_WRITTEN = re.compile(r"^ checkpoint at iteration\s+(\d+) written in the background to \S+ \(([\d.]+) s\)$")


@dataclass
class Run:
    """One launch of the command: how it ended, what it logged and what it reported saved."""

    returncode: int
    stdout: str
    stderr: str
    losses: dict[int, float]
    saved: list[int]  # iterations whose save the run reported complete (published, tracker written)
    signalled: str  # when the signal went out, for failure messages

    def show(self) -> str:
        return (f"[{self.signalled}; status {self.returncode}]\n--- stdout\n{self.stdout[-3000:]}"
                f"\n--- stderr\n{self.stderr[-3000:]}")


def _reported_saves(stdout: str) -> list[tuple[int, float]]:
    """(iteration, seconds) of every save the output reports complete."""
    out = []
    for line in stdout.splitlines():
        if m := _SAVED.match(line):
            out.append((int(m[1]), float(m[2]) / 1000.0))
        elif m := _WRITTEN.match(line):
            out.append((int(m[1]), float(m[2])))
    return out


def run_and_signal_in_a_save(cmd: list[str], rng: random.Random, sig: int, stderr_path: Path) -> Run:
    """Start ``cmd``; once it has reported 2 to 4 (random) complete saves, wait for the next
    iteration's log line (a save follows it), sleep a random part of 1.25x its longest save so far,
    and send ``sig``. Returns the whole run, waited for."""
    after_saves = rng.randint(2, 4)
    with open(stderr_path, "w") as err:
        # Ctrl-C's default action in the child even when this test runs in a background job (which
        # starts with SIGINT ignored, and a child inherits that)
        proc = subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=err, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    saves: list[tuple[int, float]] = []
    signalled = "never: the run ended first"
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            saves += _reported_saves(line)
            if "] iteration " in line and len(saves) >= after_saves:
                delay = rng.uniform(0.0, 1.25 * max(s for _, s in saves))
                time.sleep(delay)
                os.kill(proc.pid, sig)
                it = max(fault_losses(line))
                signalled = f"{signal.Signals(sig).name} {delay * 1000:5.1f} ms into the save of iteration {it:3d}"
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stdout = "".join(lines) + (rest or "")
    return Run(proc.returncode, stdout, stderr_path.read_text(), fault_losses(stdout),
               [it for it, _ in _reported_saves(stdout)], signalled)


def _final_names(save: Path) -> list[Path]:
    return sorted(p for p in save.iterdir() if re.fullmatch(r"iter_\d{7,}", p.name) and p.is_dir())


def assert_nothing_lost(save: Path, run: Run) -> int:
    """After ``run`` was stopped: the tracker is whole and names a complete checkpoint no older than
    the newest the run reported saved; every ``iter_XXXXXXX`` directory is complete, holding only
    files its markers list; the loader picks the tracker's checkpoint. Returns its iteration."""
    tracker = save / checkpointing.TRACKER
    assert tracker.is_file(), f"the tracker is gone\n{run.show()}"
    text = tracker.read_text()
    assert re.fullmatch(r"\d+\n", text), f"the tracker is half-written: {text!r}\n{run.show()}"
    newest = int(text)
    if run.saved:
        assert newest >= max(run.saved), f"reported checkpoint {max(run.saved)} lost (tracker {newest})\n{run.show()}"
        assert os.path.isdir(checkpointing.checkpoint_dir(str(save), max(run.saved))), run.show()
    final = _final_names(save)
    assert checkpointing.checkpoint_dir(str(save), newest) in [str(p) for p in final], run.show()
    for ckpt in final:
        problem = checkpointing.checkpoint_problem(str(ckpt))
        assert problem is None, f"{ckpt.name} is under its final name but {problem}\n{run.show()}"
        markers = [p for p in ckpt.iterdir() if p.name.startswith("complete_rank")]
        listed = {name for m in markers for name in json.loads(m.read_text())["files"]}
        extra = {p.name for p in ckpt.iterdir()} - listed - {m.name for m in markers}
        assert not extra, f"{ckpt.name} holds files no marker lists: {sorted(extra)}\n{run.show()}"
    assert checkpointing.find_checkpoint(str(save)) == checkpointing.checkpoint_dir(str(save), newest)
    return newest


def where_it_stopped(save: Path, before: set[str]) -> str:
    """Which part of a save the signal interrupted, judged from what it left on disk (``before``:
    the names in ``save`` when the run started)."""
    names = sorted(set(os.listdir(save)) - before)
    tmp_dirs = [n for n in names if n.endswith(".tmp") and (save / n).is_dir()]
    if tmp_dirs:
        return f"writing {tmp_dirs[0]} ({len(os.listdir(save / tmp_dirs[0]))} files)"
    newest = int((save / checkpointing.TRACKER).read_text())
    if any(int(p.name[5:]) > newest for p in _final_names(save)):
        return "between the rename and the tracker"
    if [n for n in names if n.startswith(checkpointing.TRACKER + ".")]:
        return "writing the tracker"
    if [n for n in names if n.endswith(".deleting")]:
        return "deleting an old checkpoint"
    return "outside a save"


def assert_resumed_identically(run: Run, save: Path, resumed_from: int | None, reference: dict[int, float]) -> None:
    """``run`` started from ``resumed_from`` (None: from scratch) and logged the reference's losses."""
    assert run.losses, f"no iteration logged\n{run.show()}"
    if resumed_from is None:
        assert min(run.losses) == 1, run.show()
    else:
        assert f"loaded checkpoint from {checkpointing.checkpoint_dir(str(save), resumed_from)}" in run.stdout, run.show()
        assert min(run.losses) == resumed_from + 1, run.show()
    for it, loss in run.losses.items():  # bit for bit: weights, optimizer, schedule, data position, RNG
        assert loss == reference[it], f"iteration {it}: lm loss {loss!r}, uninterrupted {reference[it]!r}\n{run.show()}"


def _cmd(save: Path, mode: str, *extra: str) -> list[str]:
    return fault_train_cmd(ITERS, "--save", str(save), "--load", str(save), "--save-interval", "1",
                           "--keep-last-checkpoints", "2", *(["--async-save"] if mode == "async" else []), *extra)


@pytest.fixture(scope="module")
def reference() -> dict[int, float]:
    """The uninterrupted run's lm loss at every iteration (saving does not change training)."""
    losses = fault_losses(run_cmd(fault_train_cmd(ITERS), env=cpu_env()).stdout)
    assert sorted(losses) == list(range(1, ITERS + 1))
    return losses


@pytest.mark.long  # the soak; the SIGTERM and SIGINT cases below run in every run
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_9_at_random_moments_of_saving_loses_nothing_and_resumes_identically(mode, reference, tmp_path):
    rng = random.Random(f"kill-{SEED}-{mode}")
    save = tmp_path / "ckpt"
    cmd = _cmd(save, mode)
    resumed_from = None
    stops = []
    for kill in range(KILLS):
        before = set(os.listdir(save)) if save.is_dir() else set()
        run = run_and_signal_in_a_save(cmd, rng, signal.SIGKILL, tmp_path / f"stderr{kill}")
        assert run.returncode == -signal.SIGKILL, f"kill {kill}: the run was not killed\n{run.show()}"
        assert_resumed_identically(run, save, resumed_from, reference)
        resumed_from = assert_nothing_lost(save, run)
        stops.append(f"{run.signalled}: {where_it_stopped(save, before)}")
    final = run_cmd(cmd, env=cpu_env())
    run = Run(final.returncode, final.stdout, final.stderr, fault_losses(final.stdout), [], "not signalled")
    assert_resumed_identically(run, save, resumed_from, reference)
    assert max(run.losses) == ITERS
    print(f"\n{mode}: {KILLS} kills (seed {SEED}):\n  " + "\n  ".join(stops))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigterm_during_a_save_exits_cleanly_and_resumes_identically(mode, reference, tmp_path):
    rng = random.Random(f"term-{SEED}-{mode}")
    save = tmp_path / "ckpt"
    cmd = _cmd(save, mode, "--exit-signal-handler")
    run = run_and_signal_in_a_save(cmd, rng, signal.SIGTERM, tmp_path / "stderr")
    assert run.returncode == 0, run.show()
    assert " received SIGTERM" in run.stdout and not run.stderr.strip(), run.show()
    newest = assert_nothing_lost(save, run)
    assert newest == max(run.losses), f"the iteration it stopped at was not saved\n{run.show()}"
    assert not [n for n in os.listdir(save) if ".tmp" in n], f"a clean exit left temporaries: {os.listdir(save)}"
    assert_resumed_identically(run, save, None, reference)
    final = run_cmd(cmd, env=cpu_env())
    resumed = Run(final.returncode, final.stdout, final.stderr, fault_losses(final.stdout), [], "not signalled")
    assert_resumed_identically(resumed, save, newest, reference)
    assert max(resumed.losses) == ITERS


@pytest.fixture(scope="module")
def sigint_run(tmp_path_factory) -> tuple[Run, Path]:
    """A synchronous run interrupted by SIGINT (Ctrl-C) in a save, and its --save directory."""
    root = tmp_path_factory.mktemp("sigint")
    save = root / "ckpt"
    run = run_and_signal_in_a_save(_cmd(save, "sync"), random.Random(f"int-{SEED}"), signal.SIGINT, root / "stderr")
    return run, save


def test_sigint_during_a_save_loses_nothing_and_resumes_identically(sigint_run, reference):
    run, save = sigint_run
    assert run.returncode != 0, run.show()
    assert_resumed_identically(run, save, None, reference)
    newest = assert_nothing_lost(save, run)
    final = run_cmd(_cmd(save, "sync"), env=cpu_env())
    resumed = Run(final.returncode, final.stdout, final.stderr, fault_losses(final.stdout), [], "not signalled")
    assert_resumed_identically(resumed, save, newest, reference)
    assert max(resumed.losses) == ITERS


def test_sigint_during_a_save_is_reported_in_one_line(sigint_run):
    run, _ = sigint_run
    assert run.returncode != 0
    assert "Traceback" not in run.stderr, run.show()
    assert len([l for l in run.stderr.splitlines() if l.strip()]) <= 1, run.show()


def test_a_deletion_cut_short_is_finished_by_the_next_save(tmp_path):
    save = tmp_path / "ckpt"
    for it in (1, 9):  # what kill -9 inside retention's rmtree leaves: 1 is saved and retired again, 9 is not
        doomed = save / f"iter_{it:07d}.deleting"
        doomed.mkdir(parents=True)
        (doomed / "__0_0.distcp").write_bytes(b"\0" * 4096)
    proc = run_cmd(fault_train_cmd(2, "--save", str(save), "--save-interval", "1", "--keep-last-checkpoints", "1"),
                   env=cpu_env(), check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert sorted(os.listdir(save)) == sorted([checkpointing.TRACKER, "iter_0000002"])
