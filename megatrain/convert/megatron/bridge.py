"""Between Megatron-LM checkpoints and megatrain's: `import_megatron` (a Megatron checkpoint into a
megatrain checkpoint, resumable: iteration, consumed samples and the LR schedule restored) and `export_megatron` (a
megatrain checkpoint into Megatron's torch_dist or legacy torch format).

The import writes through megatrain's own saver (`megatrain.checkpoint.save_checkpoint`, the same
path the Hugging Face import takes), so the result loads under any parallel layout. The optimizer
state is not carried over (Megatron keeps it by parameter index, flattened into its distributed
optimizer's buffers): the resumed run starts Adam's moments fresh and says so in one line. The
model flags that rebuild the model are recorded (``pretrain_flags``) and Megatron's ``args`` kept
under ``megatron_args`` for ``--use-checkpoint-args``.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from megatrain import checkpoint as checkpointing
from megatrain.checkpoint.save_lock import take_save_lock
from megatrain.convert.export_hf import load_full_state_dict
from megatrain.convert.import_hf import pretrain_flags
from megatrain.convert.megatron.args import config_from_megatron_args, megatron_args
from megatrain.convert.megatron.names import UnsupportedMegatronModel, from_megatron, to_megatron
from megatrain.convert.megatron.reader import MegatronCheckpoint, read_megatron_checkpoint
from megatrain.convert.megatron.writer import write_legacy, write_torch_dist
from megatrain.models.registry import get_family

__all__ = ["ImportReport", "import_megatron", "export_megatron", "megatrain_state", "optimizer_note",
           "TOKENIZER_ARGS"]

TOKENIZER_ARGS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_extra_ids")


@dataclass
class ImportReport:
    path: str  # the megatrain checkpoint directory written
    iteration: int
    config: Any
    flags: list[str]
    note: str | None  # what was left out, one line


def optimizer_note(ck: MegatronCheckpoint) -> str | None:
    if not ck.left_out:
        return None
    return (f"note: {ck.path}: its {', '.join(ck.left_out)} is not converted (Megatron keeps it by parameter "
            "index in its optimizer's own layout); the optimizer starts fresh")


def megatrain_state(ck: MegatronCheckpoint) -> tuple[Any, dict[str, torch.Tensor]]:
    """The GPT config and megatrain state dict of a read Megatron checkpoint (checked against the model)."""
    cfg = config_from_megatron_args(ck.args, ck.path)
    tensors = dict(ck.tensors)
    if not cfg.untie_embeddings_and_output_weights:
        tensors.pop("output_layer.weight", None)  # the last pipeline stage's copy of the tied embedding
    sd = from_megatron(tensors, cfg.swiglu)
    with torch.device("meta"):
        model = get_family("gpt").build_model(cfg)
    want = get_state_dict(model, [])[0]
    missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    shapes = [f"{k}: Megatron {tuple(sd[k].shape)}, model {tuple(want[k].shape)}" for k in want
              if k in sd and tuple(sd[k].shape) != tuple(want[k].shape)]
    if missing or unexpected or shapes:
        raise UnsupportedMegatronModel(f"{ck.path}: its tensors do not build the GPT model its args describe: "
                                       + "; ".join([f"missing {missing[:6]}"] * bool(missing)
                                                   + [f"unexpected {unexpected[:6]}"] * bool(unexpected) + shapes[:6]))
    return cfg, {k: v.to(want[k].dtype) if v.dtype != want[k].dtype else v for k, v in sd.items()}


def import_megatron(load: str, save: str, *, step: int | None = None, progress: bool = True,
                    quiet: bool = False) -> ImportReport:
    """Convert the Megatron checkpoint in ``load`` into the megatrain checkpoint directory ``save``."""
    ck = read_megatron_checkpoint(load, step, progress)
    cfg, sd = megatrain_state(ck)
    saved = vars(ck.args)
    tok = {k: saved.get(k) for k in TOKENIZER_ARGS if saved.get(k) is not None}
    divisible = int(saved.get("make_vocab_size_divisible_by") or 128)
    flags = pretrain_flags(cfg, tok, divisible)
    plain = {k: v for k, v in saved.items() if isinstance(v, (str, int, float, bool, type(None), list, tuple))}
    args = argparse.Namespace(**tok, converted_from=ck.path, megatron_format=ck.format, megatron_args=plain,
                              make_vocab_size_divisible_by=divisible,
                              tensor_model_parallel_size=int(saved.get("tensor_model_parallel_size") or 1),
                              pretrain_flags=flags)
    state = checkpointing.TrainState(iteration=ck.iteration, consumed_train_samples=ck.consumed_train_samples,
                                     consumed_valid_samples=ck.consumed_valid_samples)
    with torch.device("meta"):
        model = get_family("gpt").build_model(cfg)
    lock = take_save_lock(save)
    try:
        extra: dict[str, Any] = {"converted_from_megatron": ck.path}
        if ck.scheduler and all(isinstance(v, (int, float, str, type(None))) for v in ck.scheduler.values()):
            extra["scheduler"] = dict(ck.scheduler)  # Megatron's keys are megatrain's: the schedule continues
        path = checkpointing.save_checkpoint(save, state, model, None, extra, args, cfg, save_optim=False,
                                             save_rng=False, model_state=sd)
    finally:
        if lock is not None:
            lock.release()
    note = optimizer_note(ck)
    if not quiet:
        print(f" converted the Megatron-LM {ck.format} checkpoint {ck.path} (iteration {ck.iteration}, "
              f"{ck.consumed_train_samples} consumed samples) into {path}", flush=True)
        if note:
            print(" " + note, flush=True)
        print("   model flags: " + shlex.join(flags), flush=True)
    return ImportReport(path, ck.iteration, cfg, flags, note)


def export_megatron(load: str, save: str, *, saver: str, tp: int = 1, pp: int = 1, step: int | None = None,
                    transformer_impl: str = "transformer_engine", progress: bool = True) -> str:
    """Write the megatrain checkpoint in ``load`` as a Megatron checkpoint in ``save`` (``saver``:
    "mcore" for torch_dist, "megatron" for the legacy torch format under ``tp`` x ``pp``)."""
    ckpt = checkpointing.find_checkpoint(load, step)
    if ckpt is None:
        raise ValueError(f"--load-dir {load}: no megatrain checkpoint found")
    meta = checkpointing.read_meta(ckpt)
    if checkpointing.checkpoint_family(meta) != "gpt":
        raise ValueError(f"--load-dir {ckpt}: a {checkpointing.checkpoint_family(meta)} model; Megatron savers "
                         "take GPT models")
    cfg = checkpointing.checkpoint_model_config(ckpt, meta)
    tensors = to_megatron(load_full_state_dict(ckpt, cfg), cfg.swiglu)
    ts = meta.get("train_state", {})
    saved = meta.get("args") or {}
    tok = {k: saved.get(k) for k in TOKENIZER_ARGS}
    margs = megatron_args(cfg, tp=tp, pp=pp, iteration=int(ts.get("iteration", 0)),
                          consumed_train_samples=int(ts.get("consumed_train_samples", 0)),
                          consumed_valid_samples=int(ts.get("consumed_valid_samples", 0)), tokenizer=tok,
                          ckpt_format="torch_dist" if saver == "mcore" else "torch", transformer_impl=transformer_impl,
                          seq_length=saved.get("seq_length"))
    if margs.padded_vocab_size % tp:
        raise UnsupportedMegatronModel(f"--target-tensor-parallel-size {tp} does not divide the padded vocabulary "
                                       f"{margs.padded_vocab_size}")
    margs.make_vocab_size_divisible_by = int(saved.get("make_vocab_size_divisible_by") or 128)
    it = int(ts.get("iteration", 0))
    scheduler = meta.get("scheduler")
    if saver == "mcore":
        return write_torch_dist(save, tensors, margs, it, scheduler)
    return write_legacy(save, tensors, margs, it, tp=tp, pp=pp, transformer_impl=transformer_impl, progress=progress,
                        scheduler=scheduler)
