"""Shared fixtures for end-to-end tests: a tiny real corpus, tokenizer and preprocessed dataset."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_cmd(argv: list[str], timeout: int = 300, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run a command from the repository root, failing the test with its output when it fails."""
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(argv)}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> dict[str, str]:
    """~400 KB of Python stdlib sources -> BPE tokenizer (vocab 512) -> .bin/.idx; returns paths."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = root / "corpus.jsonl"
    total = 0
    with open(corpus, "w", encoding="utf-8") as f:
        for p in sorted(stdlib.glob("*.py")):
            text = p.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                f.write(json.dumps({"text": text}) + "\n")
                total += len(text)
            if total > 400_000:
                break
    tok = root / "tok"
    run_cmd([sys.executable, "-m", "megatrain", "train-tokenizer", "--input", str(corpus), "--vocab-size", "512",
             "--output-dir", str(tok)])
    tok_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"),
                 "--merge-file", str(tok / "merges.txt")]
    prefix = root / "stdlib"
    run_cmd([sys.executable, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(prefix),
             *tok_flags, "--append-eod", "--workers", "1"])
    return {"root": str(root), "data_path": f"{prefix}_text_document", "tok_flags": tok_flags}


def cpu_env() -> dict[str, str]:
    """The environment for launched CPU training processes: one thread each, so several fit on 2 cores,
    and no GPU, so that on a GPU machine they compute the same numbers as on CI's CPU."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses_and_validation(stdout: str) -> tuple[list[tuple[float, float]], list[float]]:
    """(lm loss, grad norm) of every logged iteration, and every validation loss, from a run's output."""
    from megatrain.training.logging import parse_train_log_line, parse_validation_line

    train = [parse_train_log_line(l) for l in stdout.splitlines() if "] iteration " in l]
    valid = [parse_validation_line(l)["lm loss value"] for l in stdout.splitlines() if "validation loss at" in l]
    return [(d["lm loss"], d["grad norm"]) for d in train], valid


def run_and_signal(argv: list[str], when: str, *, env: dict | None = None, pick=None,
                   sig: int = signal.SIGTERM, timeout: int = 120) -> subprocess.CompletedProcess:
    """Start ``argv`` from the repository root, send ``sig`` once a line of its output contains
    ``when`` (to the process ``pick(proc)`` names, by default the command itself), and wait for it.

    The remaining output is returned; the lines read before the signal are not."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.time() + timeout
        for line in proc.stdout:
            if when in line or time.time() > deadline:
                break
        os.kill(pick(proc) if pick else proc.pid, sig)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def assert_runs_close(got, want) -> None:
    """Two runs' (train, validation) from :func:`losses_and_validation` agree: losses and validation
    within 1e-5 relative, grad norms within 1e-3 (the log prints three decimals)."""
    import pytest

    (train, valid), (ref_train, ref_valid) = got, want
    assert len(train) == len(ref_train) and len(valid) == len(ref_valid) >= 1
    for (loss, norm), (ref_loss, ref_norm) in zip(train, ref_train):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-3)
    assert valid == pytest.approx(ref_valid, rel=1e-5)
