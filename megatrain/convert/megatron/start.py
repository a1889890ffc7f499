"""``--load DIR`` of a training run where DIR holds a Megatron-LM checkpoint (torch_dist or legacy torch).

Two steps, where the run does that kind of work already (as the Hugging Face start, `hf_start`):

1. Parse time (`apply_megatron_load`, from ``parse_args``): with ``--use-checkpoint-args`` the model
   flags come from the checkpoint's stored ``args`` (overriding the command line, as Megatron-LM
   does); a note lists them. Megatron's ``args`` are read from ``common.pt`` (or the first
   ``model_optim_rng.pt``) only.
2. Before torch.distributed starts (`prepare_megatron_start`, from the trainer): rank 0 converts the
   checkpoint (`bridge.import_megatron`) into a megatrain checkpoint in a cache directory
   (``SAVE/megatron_import/NAME-FINGERPRINT``, or ``$MEGATRAIN_MEGATRON_CACHE``), under a temporary
   name renamed when complete; the other ranks wait for it. ``--load`` then names that directory and
   the ordinary loading follows: iteration and consumed samples restored, Adam's moments and step
   where the checkpoint keeps them in a layout megatrain converts (else the optimizer fresh, a note),
   the model config compared with the flags' (one line per difference).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import shutil
import time

from megatrain.convert.hf_start import _given, cache_root
from megatrain.convert.megatron.args import config_from_megatron_args
from megatrain.convert.megatron.reader import find_megatron_iteration, is_megatron_checkpoint
from megatrain.locking import LockHeld, acquire

__all__ = ["apply_megatron_load", "prepare_megatron_start", "read_megatron_args", "CACHE_ENV"]

CACHE_ENV = "MEGATRAIN_MEGATRON_CACHE"
FORMAT = "3"  # of the cached conversion: "2" carries Adam's state, "3" a legacy one's and the fp16 loss scaler


def read_megatron_args(d: str) -> argparse.Namespace:
    """The ``args`` stored in the Megatron iteration directory ``d``."""
    from megatrain.convert.megatron.pickles import load_megatron_pt  # DCP's modules: on use, not at start-up

    common = os.path.join(d, "common.pt")
    if not os.path.isfile(common):
        ranks = sorted(n for n in os.listdir(d) if n.startswith("mp_rank_"))
        common = os.path.join(d, ranks[0], "model_optim_rng.pt") if ranks else common
    saved = load_megatron_pt(common)
    args = saved.get("args") if isinstance(saved, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise ValueError(f"--load {d}: {common} holds no Megatron args")
    return args


def apply_megatron_load(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Record a Megatron ``--load`` (``args.megatron_start``); with ``--use-checkpoint-args`` set the
    model flags from its stored args (and leave megatrain's own --use-checkpoint-args step out)."""
    args.megatron_start = None
    if not is_megatron_checkpoint(args.load, getattr(args, "ckpt_step", None)):
        return
    d = find_megatron_iteration(args.load, getattr(args, "ckpt_step", None))
    args.megatron_start = os.path.abspath(args.load)
    if not getattr(args, "use_checkpoint_args", False):
        return
    from megatrain.convert.import_hf import pretrain_flags
    from megatrain.convert.megatron.bridge import TOKENIZER_ARGS

    margs = read_megatron_args(d)
    cfg = config_from_megatron_args(margs, d)
    saved = vars(margs)
    tok = {k: saved[k] for k in TOKENIZER_ARGS if saved.get(k) is not None and getattr(args, k, None) is None}
    flags = pretrain_flags(cfg, tok, int(saved.get("make_vocab_size_divisible_by") or 128))
    if saved.get("seq_length") and not getattr(args, "seq_length", None):
        flags += ["--seq-length", str(saved["seq_length"])]
    values, unknown = _given(parser, flags)
    if unknown:
        raise ValueError(f"--load {d}: its model needs flags {parser.prog} does not have: {unknown[:3]}")
    for dest, value in values.items():
        setattr(args, dest, value)
    args.use_checkpoint_args = False  # done here: megatrain's own step reads megatrain checkpoints
    args.legacy_notes = [*getattr(args, "legacy_notes", []),
                         f"note: --use-checkpoint-args: model flags from the Megatron-LM checkpoint {d}: "
                         + shlex.join(flags)]


def _fingerprint(d: str) -> str:
    h = hashlib.sha256(f"{FORMAT}\0{os.path.abspath(d)}".encode())
    for root, _, files in sorted(os.walk(d)):
        for name in sorted(files):
            st = os.stat(os.path.join(root, name))
            h.update(f"\0{os.path.relpath(os.path.join(root, name), d)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _complete(path: str) -> bool:
    from megatrain import checkpoint as checkpointing

    try:
        return os.path.isdir(path) and checkpointing.find_checkpoint(path, verify=False) is not None
    except (SystemExit, ValueError, OSError):
        return False


def _wait_for(final: str, minutes: float) -> None:
    deadline = time.monotonic() + minutes * 60
    while not _complete(final):
        if time.monotonic() > deadline:
            raise SystemExit(f"error: waited {minutes:g} minutes for the conversion of the Megatron checkpoint into "
                             f"{final}; is it on a file system every node sees? (set {CACHE_ENV})")
        time.sleep(0.5)


def prepare_megatron_start(args: argparse.Namespace) -> None:
    """Before torch.distributed starts, on every rank: ``--load`` of a Megatron checkpoint becomes its
    converted megatrain checkpoint (rank 0 converts once; a complete conversion of the same files is reused)."""
    source = getattr(args, "megatron_start", None)
    if not source:
        return
    d = find_megatron_iteration(source, getattr(args, "ckpt_step", None))
    assert d is not None
    root = cache_root(getattr(args, "save", None), CACHE_ENV, "megatron_import")
    final = os.path.join(root, f"{os.path.basename(os.path.normpath(source)) or 'megatron'}-{_fingerprint(d)}")
    minutes = max(30.0, float(getattr(args, "distributed_timeout_minutes", 30) or 30))
    args.load, args.ckpt_step = final, None
    if _complete(final):
        return
    if int(os.environ.get("RANK", "0")) != 0:
        _wait_for(final, minutes)
        return
    os.makedirs(root, exist_ok=True)
    try:
        lock = acquire(final + ".lock", f"the conversion of {d}")
    except LockHeld:
        _wait_for(final, minutes)
        return
    from megatrain.convert.megatron.bridge import import_megatron

    try:
        if not _complete(final):
            tmp = final + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            print(f" converting the Megatron-LM checkpoint {d} into {final} (once; reused while it is unchanged)",
                  flush=True)
            try:
                report = import_megatron(d, tmp, progress=False, quiet=True)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            os.replace(tmp, final)
            if report.note:
                print(" " + report.note, flush=True)
    finally:
        lock.release()
