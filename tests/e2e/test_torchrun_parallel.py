"""`torchrun pretrain_gpt.py` with tensor + data parallelism logs the same losses as one process.

Runs on CPU with gloo: one process, then 4 processes (TP=2 x DP=2, on the tiny BPE corpus) on one node,
then the same world as two simulated nodes (two torchrun agents with --nnodes 2 --node_rank), with
sequence parallelism, ZeRO-3 and recomputation. The lm loss and grad norm of every logged iteration
and the validation loss must agree within 1e-5 relative error, and so must the weights' norm and the
gradients' zero count (--log-params-norm, --log-num-zeros-in-grad).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.conftest import assert_runs_close
from tests.e2e.conftest import REPO, run_cmd
from tests.e2e.conftest import cpu_env as _env
from tests.e2e.conftest import free_port as _free_port
from tests.e2e.conftest import losses_and_validation as _losses

ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--train-iters", "4",
        "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500",
        "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "4", "--device", "cpu",
        "--log-params-norm", "--log-num-zeros-in-grad", "--untie-embeddings-and-output-weights"]


def _norms(stdout: str) -> list[tuple[float, int]]:
    """(params norm, num zeros) of each logged iteration."""
    from megatrain.training.logging import parse_train_log_line

    lines = [parse_train_log_line(line) for line in stdout.splitlines() if "] iteration " in line]
    return [(d["params norm"], d["num zeros"]) for d in lines]


def _torchrun(*launch: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch, "pretrain_gpt.py", *ARGS]


def _assert_close(got, want) -> None:
    assert len(got[0]) == 4
    assert_runs_close(got, want)


@pytest.fixture(scope="module")
def single_process_stdout():
    return run_cmd([sys.executable, "pretrain_gpt.py", *ARGS], env=_env()).stdout


@pytest.fixture(scope="module")
def single_process(single_process_stdout):
    return _losses(single_process_stdout)


@pytest.mark.slow
@pytest.mark.long  # ~30 s: TP=2 x DP=2 under torchrun is the two-node test's below, the tiny corpus test_pretrain.py's
def test_torchrun_tp2_dp2_on_the_tiny_corpus_matches_one_process(tiny_corpus):
    """TP=2 x DP=2 on real preprocessed data (BPE-tokenized stdlib sources) against one process."""
    mock = ARGS.index("--mock-data")
    data = [*ARGS[:mock], *ARGS[mock + 5:], "--data-path", tiny_corpus["data_path"], "--split", "90,10,0",
            *tiny_corpus["tok_flags"]]
    assert "--mock-data" not in data and "--vocab-size" not in data
    ref = _losses(run_cmd([sys.executable, "pretrain_gpt.py", *data], env=_env()).stdout)
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--standalone",
                    "pretrain_gpt.py", *data, "--tensor-model-parallel-size", "2"], env=_env())
    assert "world 4 = pp 1 x dp 2 x cp 1 x tp 2" in proc.stdout
    _assert_close(_losses(proc.stdout), ref)


@pytest.mark.slow
@pytest.mark.long
def test_per_token_loss_dp2_matches_one_process(tmp_path):
    """--calculate-per-token-loss with --eod-mask-loss on short documents (micro-batches hold quite
    different numbers of loss tokens): DP=2 with ZeRO-2, context parallel 2 and pipeline parallel 2
    log the same losses as one process, and they differ from the default per-micro-batch averaging."""
    import numpy as np

    from megatrain.data.indexed_dataset import IndexedDatasetWriter

    rng = np.random.default_rng(0)
    prefix = tmp_path / "short_docs_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(400):  # NullTokenizer --vocab-size 500: ids 0..499, end of document 500
            w.add_document(np.append(rng.integers(0, 500, int(rng.integers(2, 40))), 500))
    mock = ARGS.index("--mock-data")
    data = [*ARGS[:mock], *ARGS[mock + 1:], "--data-path", str(prefix), "--split", "90,10,0", "--eod-mask-loss"]
    default = _losses(run_cmd([sys.executable, "pretrain_gpt.py", *data], env=_env()).stdout)
    data.append("--calculate-per-token-loss")
    ref = _losses(run_cmd([sys.executable, "pretrain_gpt.py", *data], env=_env()).stdout)
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                    "pretrain_gpt.py", *data, "--use-distributed-optimizer"], env=_env())
    _assert_close(_losses(proc.stdout), ref)
    cp = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                  "pretrain_gpt.py", *data, "--context-parallel-size", "2"], env=_env())
    _assert_close(_losses(cp.stdout), ref)  # each rank counts its part of every sequence
    pp = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                  "pretrain_gpt.py", *data, "--pipeline-model-parallel-size", "2"], env=_env())
    _assert_close(_losses(pp.stdout), ref)  # the last stage counts the tokens, every stage scales
    assert abs(ref[0][0][0] - default[0][0][0]) > 1e-5 * abs(default[0][0][0]), "the flag changed nothing"


@pytest.mark.slow
def test_two_node_launch_with_sp_zero3_recompute_matches_one_process(single_process, single_process_stdout):
    port = str(_free_port())
    extra = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "3",
             "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    nodes = [subprocess.Popen([*_torchrun("--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "2",
                                          "--master_addr", "127.0.0.1", "--master_port", port), *extra],
                              cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, f"--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
    # The log lines come from the last rank, which runs on the second node.
    _assert_close(_losses(outputs[1][0]), single_process)
    assert "] iteration " not in outputs[0][0]
    # --log-params-norm / --log-num-zeros-in-grad over TP- and ZeRO-3-sharded weights: each element once
    want, got = _norms(single_process_stdout), _norms(outputs[1][0])
    assert len(got) == len(want) == 4
    for (norm_a, zeros_a), (norm_b, zeros_b) in zip(want, got):
        # the untied embedding's rows of the ids a batch lacks are zero (>= 244 of 500 rows x 64); an element
        # that rounds to exactly zero in one layout's sums may not in another's
        assert norm_b == pytest.approx(norm_a, rel=1e-5) and zeros_a > 15000 and abs(zeros_b - zeros_a) <= 2, \
            (want, got)


def test_srun_style_launch_without_torchrun_matches_one_process(single_process):
    """Two plain `python pretrain_gpt.py` processes that only have SLURM_* variables (as `srun`
    starts them) form a DP=2 job and log the same losses as one process."""
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_JOB_ID="1",
                   SLURM_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "pretrain_gpt.py", *ARGS], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    _assert_close(_losses(outs[1][0]), single_process)  # the last rank prints the log lines
