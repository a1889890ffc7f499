"""SIGTERM delivered to one rank of a torchrun job (as a scheduler may do) stops every rank at the
same iteration with one complete checkpoint, instead of leaving the others hanging in a collective."""

from __future__ import annotations

import os
import sys

import pytest

from megatrain import checkpoint as checkpointing
from tests.e2e.conftest import cpu_env, run_and_signal

ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "100000", "--lr", "1e-3",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--log-interval", "1",
        "--eval-iters", "0", "--num-workers", "0", "--device", "cpu", "--exit-signal-handler"]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return sorted(out)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find the worker processes")
def test_sigterm_to_one_rank_stops_all_ranks_together(tmp_path):
    save = tmp_path / "ckpt"
    workers: list[int] = []

    def one_rank(launcher) -> int:  # one worker process only, as a scheduler may signal
        workers.extend(_children(launcher.pid))
        return workers[0]

    proc = run_and_signal([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                           "pretrain_gpt.py", *ARGS, "--save", str(save)],
                          when="iteration        3/", env=cpu_env(), pick=one_rank, timeout=180)
    assert len(workers) == 2, workers
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, err[-3000:]
    assert "received SIGTERM" in out
    iteration = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert checkpointing.checkpoint_problem(checkpointing.checkpoint_dir(str(save), iteration)) is None
