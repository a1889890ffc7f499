"""``tools/checkpoint_info.py``: what a checkpoint holds, without loading its tensors.

`checkpoint_info(path, step=None)` returns a plain dict (iteration, consumed samples, the layout
it was saved with, model family and config, parameter count, optimizer/RNG presence, size on
disk, whether it is complete, the run's arguments); `format_info` renders it as text. ``path`` is a ``--save``
directory (its newest complete checkpoint, or ``step``) or one ``iter_XXXXXXX`` directory.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence

from megatrain.checkpoint.errors import CheckpointError
from megatrain.checkpoint.layout import checkpoint_problem, find_checkpoint, iterations_in
from megatrain.checkpoint.load import model_shapes
from megatrain.checkpoint.meta import checkpoint_family, read_meta
from megatrain.checkpoint.safe_pickle import read_dcp_metadata
from megatrain.flags import OneLineArgumentParser

__all__ = ["checkpoint_info", "format_info", "main"]


def _size_on_disk(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def checkpoint_info(path: str, step: int | None = None) -> dict[str, Any]:
    ckpt = find_checkpoint(path, step)
    if ckpt is None:
        raise SystemExit(f"error: {path}: no checkpoint found")
    meta = read_meta(ckpt)
    metadata = read_dcp_metadata(ckpt)
    shapes = model_shapes(metadata)
    params = sum(math.prod(s) for s in shapes.values())
    optim_tensors = sum(1 for k in metadata.state_dict_metadata if k.startswith("optimizer."))
    save_dir = os.path.dirname(os.path.normpath(ckpt))
    others = iterations_in(save_dir)
    layout = meta.get("layout") or {"world_size": meta.get("world_size", 1)}
    return {
        "checkpoint": ckpt,
        "complete": checkpoint_problem(ckpt) is None,
        "iteration": meta["train_state"]["iteration"],
        "consumed_train_samples": meta["train_state"].get("consumed_train_samples"),
        "layout": layout,
        "family": checkpoint_family(meta),
        "model_config": meta.get("model_config", {}),
        "parameters": params,
        "tensors": len(shapes),
        "has_optimizer": bool(meta.get("has_optimizer")),
        "optimizer_tensors": optim_tensors,
        "has_rng": bool(meta.get("has_rng")),
        "size_bytes": _size_on_disk(ckpt),
        "saved_at": meta.get("saved_at"),
        "torch_version": meta.get("torch_version"),
        "format_version": meta.get("format_version", 1),
        "iterations_in_save_dir": sorted(others),
        "fp8_scaling": _fp8_scaling_summary(meta.get("fp8_scaling")),
        "args": meta.get("args", {}),
    }


def _fp8_scaling_summary(state: Any) -> dict[str, Any] | None:
    """Delayed fp8 scaling's saved state in brief: the recipe, the layers, the range of their scales."""
    if not isinstance(state, dict) or not isinstance(state.get("layers"), dict):
        return None
    scales = [row[0] for entry in state["layers"].values() if isinstance(entry, dict)
              for row in entry.values() if isinstance(row, list) and row and isinstance(row[0], (int, float))]
    return {"recipe": state.get("recipe"), "layers": len(state["layers"]),
            "scale_range": [min(scales), max(scales)] if scales else None}


def format_info(info: dict[str, Any], show_args: bool = True) -> str:
    lay = info["layout"]
    if "tensor_model_parallel_size" in lay:
        layout = (f"world {lay['world_size']} = tp {lay['tensor_model_parallel_size']} x pp "
                  f"{lay['pipeline_model_parallel_size']} x cp {lay['context_parallel_size']} x dp "
                  f"{lay['data_parallel_size']} (ZeRO stage {lay['zero_stage']}, sequence parallel "
                  f"{'on' if lay['sequence_parallel'] else 'off'})")
    else:
        layout = f"world {lay.get('world_size', 1)}"
    cfg = info["model_config"]
    shape = [f"{k} {cfg[k]}" for k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                                        "ffn_hidden_size", "vocab_size", "max_position_embeddings") if k in cfg]
    model = ", ".join([info["family"], *shape])
    lines = [
        f"checkpoint:        {info['checkpoint']}" + ("" if info["complete"] else "  (INCOMPLETE)"),
        f"iteration:         {info['iteration']}",
        f"consumed samples:  {info['consumed_train_samples']}",
        f"saved with:        {layout}",
        f"model:             {model}",
        f"parameters:        {info['parameters']:,} in {info['tensors']} tensors",
        f"optimizer state:   {'yes' if info['has_optimizer'] else 'no'}"
        + (f" ({info['optimizer_tensors']} entries)" if info["has_optimizer"] else ""),
        f"RNG states:        {'yes' if info['has_rng'] else 'no'}",
        f"size on disk:      {_human(info['size_bytes'])} ({info['size_bytes']:,} bytes)",
        f"saved at:          {info['saved_at']} (torch {info['torch_version']}, format {info['format_version']})",
        f"in the directory:  iterations {', '.join(map(str, info['iterations_in_save_dir']))}",
    ]
    fp8 = info.get("fp8_scaling")
    if fp8 is not None:
        recipe = fp8.get("recipe") or {}
        scales = fp8["scale_range"]
        lines.insert(-1, f"fp8 scaling:       delayed (amax history {recipe.get('history_len')}, "
                         f"{recipe.get('amax_compute_algo')}, margin {recipe.get('margin')}), {fp8['layers']} layers"
                         + (f", scales {scales[0]:.4g} to {scales[1]:.4g}" if scales else ""))
    if show_args:
        lines.append("arguments:")
        lines += [f"  {k} = {json.dumps(v)}" for k, v in sorted(info["args"].items())]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = OneLineArgumentParser(prog="checkpoint_info.py", description=__doc__.splitlines()[0])
    p.add_argument("path", help="a --save directory or one iter_XXXXXXX directory")
    p.add_argument("--ckpt-step", type=int, default=None, help="this iteration instead of the newest")
    p.add_argument("--json", action="store_true", help="print the information as JSON")
    p.add_argument("--no-args", action="store_true", help="leave out the run's arguments")
    a = p.parse_args(argv)
    try:
        info = checkpoint_info(a.path, a.ckpt_step)
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    if a.no_args:
        info.pop("args")
    print(json.dumps(info, indent=1) if a.json else format_info(info, show_args=not a.no_args))


if __name__ == "__main__":
    main()
