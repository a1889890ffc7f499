"""``--dist-ckpt-strictness`` (Megatron-LM's flag): what a load does with the tensors the model and the
checkpoint do not share.

Megatron names the two kinds the other way round from PyTorch's ``load_state_dict``: its *unexpected*
keys are tensors the model asks for that the checkpoint does not hold (loading around them leaves them
at their initial values), its *missing* keys are tensors the checkpoint holds that the model does not
ask for (they stay unread). megatrain's messages say which is which in words and give Megatron's name.

========================  ==============================  ==============================
mode                      model tensors not in the        checkpoint tensors not in the
                          checkpoint ("unexpected")       model ("missing")
========================  ==============================  ==============================
assume_ok_unexpected      refused                         refused (Megatron: unread)
raise_unexpected          refused                         unread
raise_all                 refused                         refused
log_unexpected            initial values, one line        unread
log_all                   initial values, one line        unread, one line
return_unexpected         as log_unexpected               as log_unexpected
return_all                as log_all                      as log_all
ignore_all                initial values                  unread
========================  ==============================  ==============================

``assume_ok_unexpected``, Megatron's default, leaves the check to the loader: Megatron's torch_dist
loader refuses a model tensor the checkpoint lacks and reads past a tensor the model lacks. megatrain's
loader has always refused both, and still does by default: a megatrain checkpoint holds exactly the
tensors of the model its config builds (the config is compared first), so a tensor the model does not
have means the checkpoint holds another model than the one the flags build. ``raise_unexpected`` is
Megatron's default behaviour exactly (and the refusal says so). Megatron's ``return_*`` modes hand the
keys back to a Python caller; a training run has none, so they log them. ``--finetune`` keeps its own
rule under the default mode (the tensors both have are loaded, the others named in one warning); a
mode given explicitly applies under ``--finetune`` as well.

Model tensors left at their initial values also start with a fresh optimizer state.
"""

from __future__ import annotations

from functools import reduce
from operator import or_
from typing import Any, Iterable

import torch.distributed as dist

from megatrain.checkpoint.errors import CheckpointError
from megatrain.checkpoint.ranks import dist_on, warn, world

__all__ = ["STRICTNESS_MODES", "DEFAULT_STRICTNESS", "handling", "report_mismatch", "mismatch_over_ranks",
           "name_keys"]

STRICTNESS_MODES = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                    "return_unexpected", "return_all", "ignore_all")
DEFAULT_STRICTNESS = "assume_ok_unexpected"

# mode -> (model tensors not in the checkpoint, checkpoint tensors not in the model): "raise", "log" or "ignore"
_HANDLING: dict[str, tuple[str, str]] = {
    "assume_ok_unexpected": ("raise", "raise"),
    "raise_unexpected": ("raise", "ignore"),
    "raise_all": ("raise", "raise"),
    "log_unexpected": ("log", "ignore"),
    "log_all": ("log", "log"),
    "return_unexpected": ("log", "ignore"),
    "return_all": ("log", "log"),
    "ignore_all": ("ignore", "ignore"),
}
assert set(_HANDLING) == set(STRICTNESS_MODES)

SHOWN = 8  # names given in a message before "and N more"


def handling(strictness: str) -> tuple[str, str]:
    """(what happens to model tensors the checkpoint lacks, to checkpoint tensors the model lacks)."""
    try:
        return _HANDLING[strictness]
    except KeyError:
        raise ValueError(f"--dist-ckpt-strictness {strictness!r}: expected one of "
                         f"{', '.join(STRICTNESS_MODES)}") from None


def name_keys(keys: list[str]) -> str:
    """``a, b, c and 5 more``."""
    shown = ", ".join(keys[:SHOWN])
    return shown + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _absent_words(keys: list[str]) -> str:
    return f"lacks {_count(len(keys), 'tensor')} the model has (Megatron's \"unexpected\" keys): {name_keys(keys)}"


def _extra_words(keys: list[str]) -> str:
    return (f"holds {_count(len(keys), 'tensor')} the model does not have (Megatron's \"missing\" keys): "
            f"{name_keys(keys)}")


def report_mismatch(ckpt: str, strictness: str, absent: list[str], extra: list[str]) -> None:
    """Apply ``strictness`` to the model tensors ``ckpt`` lacks (``absent``) and the tensors it holds that the
    model lacks (``extra``): one `CheckpointError` line naming the flag and the keys where the mode refuses
    them, else one warning line per kind (rank 0) where it logs them, else nothing. Every rank must pass the
    same lists (`mismatch_over_ranks`), so that all refuse together."""
    on_absent, on_extra = handling(strictness)
    refuse_absent, refuse_extra = bool(absent) and on_absent == "raise", bool(extra) and on_extra == "raise"
    if refuse_absent or refuse_extra:
        parts = [_absent_words(absent)] * refuse_absent + [_extra_words(extra)] * refuse_extra
        if refuse_absent and refuse_extra:
            hint = "log_all loads the tensors both have and names the others, as --finetune does"
        elif refuse_absent:
            hint = "log_unexpected loads the rest, leaving these at their initial values"
        else:
            hint = "raise_unexpected (Megatron's default behaviour) leaves them unread"
        mode = strictness + (" (the default)" if strictness == DEFAULT_STRICTNESS else "")
        raise CheckpointError(f"--dist-ckpt-strictness {mode}: checkpoint {ckpt} " + "; it also ".join(parts)
                              + f" (--dist-ckpt-strictness {hint})")
    if absent and on_absent == "log":
        warn(f"--dist-ckpt-strictness {strictness}: checkpoint {ckpt} {_absent_words(absent)}; they keep their "
             "initial values and start with a fresh optimizer state")
    if extra and on_extra == "log":
        warn(f"--dist-ckpt-strictness {strictness}: checkpoint {ckpt} {_extra_words(extra)}; they are not loaded")


def _held_mask(names: list[str], held: Iterable[str]) -> int:
    """Bit i set where ``names[i]`` is held (a compact value to gather from every rank)."""
    held = set(held)
    bits = "".join("1" if n in held else "0" for n in reversed(names))
    return int(bits or "0", 2)


def mismatch_over_ranks(diff: dict[str, list[str]], ckpt_names: Iterable[str], model_names: Iterable[str],
                        partial: bool) -> dict[str, list[str]]:
    """`compare_model`'s differences as all ranks agree on them: ``missing``, the model tensors that are
    not in the checkpoint on any rank; ``shape``, any rank's shape differences; ``unexpected``, the
    checkpoint tensors that no rank's model has. ``partial``: each rank's model holds only some of the
    tensors (one pipeline stage's); one process then names no checkpoint tensor unused (it cannot know)."""
    names = sorted(ckpt_names)
    mask = _held_mask(names, model_names)
    missing, shape = diff["missing"], diff["shape"]
    if dist_on() and world() > 1:
        everyone: list[Any] = [None] * world()
        dist.all_gather_object(everyone, (missing, shape, mask))
        missing = sorted({k for keys, _, _ in everyone for k in keys})
        shape = sorted({line for _, lines, _ in everyone for line in lines})
        mask = reduce(or_, (m for _, _, m in everyone))
    elif partial:
        return {"missing": missing, "unexpected": [], "shape": shape}
    return {"missing": missing, "unexpected": [n for i, n in enumerate(names) if not mask >> i & 1],
            "shape": shape}
