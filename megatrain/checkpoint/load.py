"""Loading a checkpoint into a built model (and optimizer, RNG) in place.

`load_checkpoint` first holds the checkpoint to the model: the same model family
(`megatrain.checkpoint.compat`), the config values the family's table compares, and the tensor
shapes; it refuses a mismatch with a list of the differences (``finetune=True`` loads the
tensors both have, same shape); Megatron's ``--dist-ckpt-strictness`` decides what becomes of the
tensors only one side has (`megatrain.checkpoint.strictness`). Nothing is unpickled beyond plain
data: DCP's ``.metadata`` is read with an exact allowlist (`megatrain.checkpoint.safe_pickle`) and handed to DCP
(`megatrain.checkpoint.dcp_reader`); tensors and RNG files load with ``weights_only=True``. A
loaded state holding NaN/Inf is refused unless told otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatrain.checkpoint import integrity
from megatrain.checkpoint.compat import config_differences, config_warnings, family_problem
from megatrain.checkpoint.errors import CheckpointError
from megatrain.checkpoint.meta import read_meta
from megatrain.checkpoint.ranks import dist_on, rank, single_process_quiet, warn, world
from megatrain.checkpoint.safe_pickle import load_tensors_file, read_dcp_metadata
from megatrain.checkpoint.state import optim_options, rng_name, set_rng_state
from megatrain.checkpoint.strictness import DEFAULT_STRICTNESS, mismatch_over_ranks, report_mismatch
from megatrain.models.common.config_checks import ConfigCheck

__all__ = ["load_checkpoint", "restore_rng", "resume_vocab_size", "compare_model", "model_shapes"]


def resume_vocab_size(ckpt: str, padded: int, true_vocab: int, tensor_parallel_size: int) -> int:
    """The padded vocabulary to build when loading ``ckpt``: the checkpoint's, when it fits this layout.

    Megatron pads the vocabulary to a multiple of ``--make-vocab-size-divisible-by x TP``, so a
    checkpoint saved under another TP size can have more (or fewer) padding rows. Its size is kept
    when it holds the whole vocabulary and divides by the new TP size; the padding rows never
    receive a target, so the run continues with the same numbers.
    """
    saved = int(read_meta(ckpt).get("model_config", {}).get("vocab_size", padded))
    if saved == padded or saved < true_vocab or saved % tensor_parallel_size:
        return padded
    if rank() == 0:
        print(f" note: using the checkpoint's padded vocabulary of {saved} (the flags give {padded}; the "
              f"padding depends on --make-vocab-size-divisible-by x --tensor-model-parallel-size)", flush=True)
    return saved


def compare_model(ckpt_shapes: dict[str, tuple[int, ...]], model_sd: dict[str, Any]) -> dict[str, list[str]]:
    """Tensor names missing from the checkpoint, unexpected in it, and present in both with other shapes."""
    want = {k: tuple(v.shape) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    return {"missing": sorted(k for k in want if k not in ckpt_shapes),
            "unexpected": sorted(k for k in ckpt_shapes if k not in want),
            "shape": sorted(f"{k}: checkpoint {list(ckpt_shapes[k])}, model {list(want[k])}"
                            for k in want if k in ckpt_shapes and tuple(ckpt_shapes[k]) != want[k])}


def model_shapes(metadata: Any) -> dict[str, tuple[int, ...]]:
    """The global shape of each model tensor in a checkpoint's DCP metadata, by parameter name."""
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(md, "size"):
            out[key[len("model."):]] = tuple(md.size)
    return out


def _mismatch(ckpt: str, lines: list[str], finetune: bool) -> CheckpointError:
    return CheckpointError(f"checkpoint {ckpt} does not match the model built from the flags:\n  "
                           + "\n  ".join(lines[:40]) + (f"\n  ... and {len(lines) - 40} more" if len(lines) > 40
                                                       else "")
                           + "\n(--use-checkpoint-args builds the checkpoint's model"
                           + ("" if finetune else "; --finetune loads only the tensors both have, when "
                                                  "their shapes agree") + ")")


def load_checkpoint(ckpt: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                    load_optim: bool = True, load_rng: bool = True, model_config: Any = None,
                    config_checks: Mapping[str, ConfigCheck] | None = None, finetune: bool = False,
                    allow_non_finite: bool = False, partial: bool = False,
                    strictness: str = DEFAULT_STRICTNESS) -> dict[str, Any]:
    """Load model (and optimizer, RNG) state in place; returns the checkpoint's meta data (`read_meta`).

    With ``model_config`` (the flags' config) a checkpoint of another model family is refused,
    and so is one whose config differs in a value ``config_checks`` compares (by default the
    table of ``model_config``'s family); under ``finetune`` config differences are a warning,
    tensors that exist in both with the same shape are loaded and the model's others keep their
    values. Without ``model_config`` (exporters, inference: the model is built from the
    checkpoint's own config) no config is compared. Differing tensor shapes are always refused,
    as is a loaded tensor holding NaN/Inf (on every rank alike) unless ``allow_non_finite``.
    ``partial``: ``model`` holds only some of the checkpoint's tensors (one pipeline rank's stages),
    so the others are not "unexpected" (the ranks agree on which tensors none of them has).
    ``strictness`` (``--dist-ckpt-strictness``): model tensors the checkpoint lacks and checkpoint tensors
    the model lacks are refused by default (under ``finetune`` loaded around, with a warning); the other
    modes refuse, name or ignore each kind (`megatrain.checkpoint.strictness`). Model tensors loaded around
    keep their values and start with a fresh optimizer state.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from megatrain.checkpoint.dcp_reader import load_dcp  # DCP is imported on use, not at start-up

    meta = read_meta(ckpt)
    if model_config is not None:
        problem = family_problem(ckpt, meta, model_config)
        if problem:
            raise CheckpointError(problem)
    metadata = read_dcp_metadata(ckpt)
    model_sd = get_state_dict(model, [])[0]
    ckpt_shapes = model_shapes(metadata)
    # the same differences on every rank (a pipeline rank holds its stages' tensors only), so all refuse alike
    diff = mismatch_over_ranks(compare_model(ckpt_shapes, model_sd), ckpt_shapes, model_sd, partial)
    saved_cfg = meta.get("model_config", {})
    cfg_diff: list[str] = []
    if model_config is not None:
        cfg_diff = config_differences(saved_cfg, model_config, config_checks)
        for line in config_warnings(ckpt, saved_cfg, model_config, config_checks):
            warn(line)
    fatal = diff["shape"] or (not finetune and cfg_diff)
    if fatal:
        lines = cfg_diff + [f"shape differs: {s}" for s in diff["shape"]]
        if not finetune:
            lines += [f"not in the checkpoint: {k}" for k in diff["missing"]]
            lines += [f"in the checkpoint but not in the model: {k}" for k in diff["unexpected"]]
        raise _mismatch(ckpt, lines, finetune)
    if finetune and cfg_diff:  # as Megatron-LM, --finetune does not hold the model to the checkpoint's
        warn(f"--finetune: the model differs from checkpoint {ckpt}'s: " + "; ".join(cfg_diff))
    if finetune and strictness == DEFAULT_STRICTNESS:
        if diff["missing"] or diff["unexpected"]:
            warn(f"--finetune: {len(diff['missing'])} tensors keep their initial values (not in the checkpoint: "
                 f"{', '.join(diff['missing'][:8])}); {len(diff['unexpected'])} checkpoint tensors are not used")
    else:
        report_mismatch(ckpt, strictness, diff["missing"], diff["unexpected"])
    has_optim = bool(meta.get("has_optimizer", False))
    if load_optim and optimizer is not None and not has_optim:
        why = (f"converted from the Megatron-LM checkpoint {meta['converted_from_megatron']}, whose optimizer state "
               "is absent or in a layout megatrain does not convert" if meta.get("converted_from_megatron")
               else "saved with --no-save-optim")
        warn(f"checkpoint {ckpt} holds no optimizer state ({why}); the optimizer starts fresh")
    load_optim = load_optim and optimizer is not None and has_optim
    if load_optim:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=optim_options())
        sd: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
    else:
        sd = {"model": model_sd}
    absent = set(diff["missing"])  # allowed to keep their values: not read, nor their optimizer state
    wanted = {part: {k: v for k, v in entries.items() if _owner(k, part) not in absent}
              for part, entries in sd.items()} if absent else sd
    with single_process_quiet():
        load_dcp(wanted, ckpt, metadata)
    _refuse_non_finite(ckpt, wanted, allow_non_finite)
    if absent:
        for part, entries in wanted.items():  # values DCP replaced rather than filled in place
            sd[part].update(entries)
    if load_optim:
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"],
                       options=optim_options())
        params = dict(model.named_parameters())
        for name in absent:  # a fresh start (the state get_state_dict set up is one step old)
            if name in params:
                optimizer.state.pop(params[name], None)
    else:
        set_state_dict(model, [], model_state_dict=sd["model"], optim_state_dict={},
                       options=StateDictOptions(strict=True))
    if load_rng:
        restore_rng(ckpt, meta)
    return meta


def _owner(key: str, part: str) -> str:
    """The model tensor an entry of the state dict belongs to: a model key itself; an optimizer key
    (flattened: ``state.<name>.exp_avg``, ``param_groups.<name>.lr``) its parameter's name."""
    if part != "optimizer":
        return key
    head, _, rest = key.partition(".")
    return rest.rpartition(".")[0] if head in ("state", "param_groups") else key


def _refuse_non_finite(ckpt: str, sd: dict[str, Any], allow: bool) -> None:
    """CheckpointError (on every rank) naming the loaded tensors with NaN/Inf values; a warning with ``allow``."""
    bad = integrity.non_finite_tensors(sd)
    if dist_on() and world() > 1:
        everyone: list[Any] = [None] * world()
        dist.all_gather_object(everyone, bad)
        bad = sorted({name for names in everyone for name in names})
    if not bad:
        return
    names = ", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
    count = f"{len(bad)} tensor{'s' if len(bad) > 1 else ''}"
    if allow:
        warn(f"checkpoint {ckpt} holds NaN/Inf values in {count} ({names}); loading them "
             f"(--allow-non-finite-checkpoint)")
        return
    raise CheckpointError(f"checkpoint {ckpt} holds NaN/Inf values in {count} ({names}); training "
                          f"from it would produce NaN losses (load an earlier checkpoint, or pass "
                          f"--allow-non-finite-checkpoint to load it anyway)")


def restore_rng(ckpt: str, meta: dict[str, Any] | None = None) -> bool:
    """Set this rank's RNG states from the checkpoint; False (with a warning) when it holds none for this rank.

    Call it last when resuming: anything that draws random numbers afterwards (creating a
    DataLoader iterator draws one) would otherwise shift the streams against the original run.
    """
    meta = read_meta(ckpt) if meta is None else meta
    if not meta.get("has_rng"):
        return False
    rng_file = os.path.join(ckpt, rng_name(rank()))
    if not os.path.isfile(rng_file):
        warn(f"checkpoint {ckpt} has no RNG state for rank {rank()} (saved with {meta.get('world_size')} "
             f"ranks); this rank keeps its seeded RNG")
        return False
    state = load_tensors_file(rng_file)
    try:
        set_rng_state(state)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{rng_file}: not an RNG state file ({type(e).__name__}: {e})") from None
    return True
