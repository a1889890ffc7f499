"""Loading a trained model (and its tokenizer settings) from a checkpoint for inference."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from megatrain.models.registry import get_family
from megatrain import checkpoint as checkpointing


def load_model(load: str, device: torch.device, step: int | None = None,
               tp_mesh: DeviceMesh | None = None) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Build the model a checkpoint describes and load its weights; returns (model in eval mode, meta).

    With ``tp_mesh`` (every rank of a torchrun job calls this) the model is tensor-parallel: each
    rank loads only its shards, and the logits are gathered so that every rank samples the same
    tokens.
    """
    ckpt = checkpointing.find_checkpoint(load, step)
    if ckpt is None:
        raise SystemExit(f"error: --load {load}: no checkpoint found")
    meta = checkpointing.read_meta(ckpt)
    config = checkpointing.checkpoint_model_config(ckpt, meta)
    family = get_family(checkpointing.checkpoint_family(meta))
    with torch.device("meta"):
        model = family.build_model(config)
    if tp_mesh is not None:
        from megatrain.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, tp_mesh, plan=family.tensor_parallel_plan(model, sequence_parallel=False))
        sharded_logits = model.logits

        def gathered_logits(hidden: torch.Tensor) -> torch.Tensor:
            logits = sharded_logits(hidden)
            return logits.full_tensor() if isinstance(logits, DTensor) else logits

        model.logits = gathered_logits  # type: ignore[method-assign]
    model.to_empty(device=device)
    checkpointing.load_checkpoint(ckpt, model, None, load_optim=False, load_rng=False)
    model.eval()
    return model, meta


TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size", "vocab_extra_ids")


def fill_tokenizer_args(args: argparse.Namespace, meta: dict[str, Any]) -> argparse.Namespace:
    """Tokenizer flags not given on the command line are taken from the checkpoint's run arguments
    (``--vocab-extra-ids``, whose flag defaults to 0, when it is 0)."""
    saved = meta.get("args", {})
    for name in TOKENIZER_FIELDS:
        current = getattr(args, name, None)
        unset = current is None or (name == "vocab_extra_ids" and current == 0)
        if unset and saved.get(name) is not None:
            setattr(args, name, saved[name])
    return args
