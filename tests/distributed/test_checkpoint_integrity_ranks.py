"""Checkpoint integrity with two gloo ranks: the ranks share the checksum verification and agree on
its outcome, the --save lock's refusal reaches every rank, and a write failing on one rank only
(a real file-size limit: EFBIG) is the same one line on both, the earlier checkpoint kept."""

from __future__ import annotations

import argparse
import os
import resource
import signal

from dist_harness import run_workers

from megatrain.checkpoint import save_lock
from megatrain.locking import acquire
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel
from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import TrainState

CONFIG = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, max_position_embeddings=8,
                   hidden_dropout=0.0, attention_dropout=0.0)


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except SystemExit as e:
        return ("exit", str(e))
    except checkpointing.CheckpointError as e:
        return ("error", str(e))


def _worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    model = GPTModel(CONFIG)
    model.init_weights(1)
    save = os.path.join(root, "ckpt")
    for it in (1, 2):
        checkpointing.save_checkpoint(save, TrainState(iteration=it), model, None, {}, argparse.Namespace(), CONFIG)
    newest = checkpointing.checkpoint_dir(save, 2)
    out: dict = {"files": sorted(os.listdir(newest))}
    if rank == 1:  # damage a file only rank 1 verifies (the files rank 1 wrote)
        victim = next(n for n in sorted(os.listdir(newest)) if n.startswith("rng_rank00001"))
        with open(os.path.join(newest, victim), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 1]))
    dist.barrier()
    out["search"] = _outcome(checkpointing.find_checkpoint, save)
    out["named"] = _outcome(checkpointing.find_checkpoint, save, 2)
    out["unverified"] = _outcome(lambda: checkpointing.find_checkpoint(save, 2, verify=False))

    holder = acquire(os.path.join(save, save_lock.LOCK_NAME), "another run") if rank == 0 else None
    out["lock"] = _outcome(save_lock.take_save_lock, save)
    if holder is not None:
        holder.release()

    if rank == 1:  # writes beyond 1 KB fail on this rank only (EFBIG instead of the signal)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
    out["efbig"] = _outcome(checkpointing.save_checkpoint, save, TrainState(iteration=3), model, None, {},
                            argparse.Namespace(), CONFIG)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    dist.barrier()
    out["after"] = sorted(os.listdir(save))
    out["tracker"] = open(os.path.join(save, checkpointing.TRACKER)).read()
    return out


def test_two_ranks_share_verification_lock_refusal_and_save_failures(tmp_path):
    r0, r1 = run_workers(_worker, 2, str(tmp_path))
    assert any(n.startswith("rng_rank00001") for n in r0["files"])
    older = str(tmp_path / "ckpt" / "iter_0000001")
    assert r0["search"] == r1["search"] == ("ok", older)  # rank 1 found the damage; both fall back
    assert r0["named"] == r1["named"] and r0["named"][0] == "exit"
    assert "--ckpt-step 2" in r0["named"][1] and "rng_rank00001.pt is damaged" in r0["named"][1]
    assert r0["unverified"] == r1["unverified"] == ("ok", str(tmp_path / "ckpt" / "iter_0000002"))
    assert r0["lock"] == r1["lock"] and r0["lock"][0] == "exit" and "is in use by pid" in r0["lock"][1]
    assert r0["efbig"][0] == r1["efbig"][0] == "error"
    for r in (r0, r1):
        message = r["efbig"][1]
        assert "\n" not in message and "cannot write the checkpoint of iteration 3: File too large" in message
    assert r0["after"] == r1["after"] == ["iter_0000001", "iter_0000002", checkpointing.TRACKER]
    assert r0["tracker"] == "2\n"
