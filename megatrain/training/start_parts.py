"""A fresh model's parts started from their own checkpoints (a family's ``start_parts``: LLaVA's
``--language-model-checkpoint`` and ``--vision-model-checkpoint``), before training, when the run
resumes or fine-tunes no checkpoint of the whole model.

Each part is a submodule path of the model and a folder: a megatrain checkpoint of that part (its
tensors named as the part's own, e.g. a GPT checkpoint for ``language_model``), loaded through the
checkpoint package; or a Hugging Face folder, read by ``megatrain.convert`` and converted by the
family's function into the part's state dict, which must hold every tensor of the part with its
shape. Every rank loads the same weights; a failure is one line naming the flag and the folder.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from megatrain import checkpoint as checkpointing
from megatrain.training.console import print_rank0

__all__ = ["start_parts"]


def _from_hf(flag: str, folder: str, convert: Callable[..., Any], part: torch.nn.Module) -> None:
    from megatrain.convert.import_hf import read_hf_config, read_hf_weights

    try:
        given = convert(read_hf_config(folder), read_hf_weights(folder))
    except ValueError as e:
        raise SystemExit(f"error: {flag} {folder}: {e}") from None
    own = part.state_dict()
    wrong = [f"{k} (missing)" if k not in given else f"{k} {tuple(given[k].shape)} for {tuple(v.shape)}"
             for k, v in own.items() if k not in given or given[k].shape != v.shape]
    if wrong:
        raise SystemExit(f"error: {flag} {folder}: does not fit the flags' model: {', '.join(wrong[:3])}"
                         + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""))
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(given[k].to(v.dtype))


def start_parts(parts: Sequence[tuple[str, str, str, Callable[..., Any] | None]], module: torch.nn.Module, *,
                verify: bool = True) -> None:
    """Load each ``(flag, submodule path, folder, convert)`` of ``parts`` into ``module`` (module doc)."""
    for flag, path, folder, convert in parts:
        part = module.get_submodule(path)
        if convert is None:
            ckpt = checkpointing.find_checkpoint(folder, verify=verify)
            if ckpt is None:
                raise SystemExit(f"error: {flag} {folder}: no checkpoint found")
            try:
                checkpointing.load_checkpoint(ckpt, part, None, load_optim=False, load_rng=False)
            except checkpointing.CheckpointError as e:
                raise SystemExit(f"error: {flag} {folder}: {e}") from None
            folder = ckpt
        else:
            _from_hf(flag, folder, convert, part)
        print_rank0(f" loaded {path} from {flag} {folder}")
