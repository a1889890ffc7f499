"""What the ``pretrain_vlm.py`` end-to-end tests share: running the script (one process or torchrun), its
log's losses, the two-image lines they add to the family's jsonl, and an energon folder of VQA samples."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.e2e.conftest import cpu_env, run_cmd
from tests.unit.test_llava_family import COLORS, vlm_args, write_llava_data

__all__ = ["run_vlm", "run_losses", "train_lines", "losses", "same_losses", "same_checkpoint_parameters",
           "with_two_image_lines", "energon_vqa_flags"]


def run_vlm(flags: list[str], nproc: int = 1, check: bool = True):
    """``pretrain_vlm.py FLAGS`` on the CPU, in one process or under ``torchrun --nproc-per-node N``."""
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc-per-node={nproc}"]
    return run_cmd([*launch, "pretrain_vlm.py", *flags], env=cpu_env(), check=check)


def train_lines(stdout: str) -> list[dict]:
    from megatrain.training.logging import parse_train_log_line

    return [parse_train_log_line(x) for x in stdout.splitlines() if "] iteration " in x]


def losses(stdout: str) -> list[float]:
    return [d["lm loss"] for d in train_lines(stdout)]


def same_losses(one: list[tuple[float, float]], other: list[tuple[float, float]]) -> None:
    """Two runs' (loss, gradient norm) per iteration agree to 1e-5."""
    assert len(one) == len(other) and one, (one, other)
    for (loss_a, norm_a), (loss_b, norm_b) in zip(one, other):
        assert loss_b == pytest.approx(loss_a, rel=1e-5), (one, other)
        assert norm_b == pytest.approx(norm_a, rel=1e-5), (one, other)


def with_two_image_lines(paths: dict[str, str], lines: range) -> list[dict]:
    """Rewrite ``lines`` of the jsonl as two-image samples (the answer from the second image); returns
    every row."""
    rows = [json.loads(x) for x in open(paths["data"])]
    names = sorted(COLORS)
    for k in lines:
        rgb, answer = COLORS[names[(k + 1) % 3]]
        Image.new("RGB", (19, 17), COLORS[names[k % 3]][0]).save(f"{paths['images']}/m{k}a.png")
        Image.new("RGB", (21, 16), rgb).save(f"{paths['images']}/m{k}b.png")
        rows[k] = {"id": f"m{k}", "image": [f"m{k}a.png", f"m{k}b.png"], "conversations": [
            {"from": "human", "value": "<image>\n<image>\nwhat is this ?"}, {"from": "gpt", "value": answer}]}
    with open(paths["data"], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def energon_vqa_flags(tmp_path: Path, samples: int = 16) -> list[str]:
    """The family's flags with ``--data-path`` an energon folder of ``samples`` VQA samples."""
    from megatrain.data.multimodal import energon as mm_energon
    from tests.unit.test_multimodal_data import write_shards

    paths = write_llava_data(tmp_path / "tok", n=1)
    rng = random.Random(1)
    items = []
    for k in range(samples):
        rgb, answer = COLORS[rng.choice(sorted(COLORS))]
        items.append((f"{k:06d}", Image.new("RGB", (20 + k % 3, 18), rgb), {"question": "what is this ?",
                                                                            "answers": [answer]}))
    root = tmp_path / "wds"
    root.mkdir()
    mm_energon.prepare_dataset(str(root), write_shards(root, items, per_shard=4), "VQASample",
                               {"image": "jpg", "context": "json[question]", "answers": "json[answers]"})
    return [f if f != paths["data"] else str(root) for f in vlm_args(paths)]


def same_checkpoint_parameters(one_dir: str, other_dir: str, step: int) -> None:
    """Two runs' checkpoints at ``step`` hold the same parameters under the same names (relative 1e-5).

    The attention key biases are left out: their gradient is 0 in exact arithmetic (softmax is
    shift-invariant), so Adam turns rounding noise into steps that differ with the layout without
    changing any output. The tests' encoders have 4 heads of 8 channels, q/k/v rows per head."""
    import torch

    from megatrain.inference.loading import load_model

    one, _ = load_model(one_dir, torch.device("cpu"), step)
    other_model, _ = load_model(other_dir, torch.device("cpu"), step)
    a, b = one.state_dict(), other_model.state_dict()
    assert a.keys() == b.keys()
    for name, value in a.items():
        other = b[name]
        if name.endswith("self_attention.linear_qkv.bias"):
            keep = torch.ones_like(value, dtype=torch.bool).view(4, 3, 8)
            keep[:, 1] = False
            value, other = value[keep.flatten()], other[keep.flatten()]
        scale = value.abs().max().clamp_min(1e-12)
        assert ((value - other).abs().max() / scale).item() < 1e-5, name


def run_losses(flags: list[str], nproc: int = 1) -> list[tuple[float, float]]:
    """(loss, gradient norm) of each iteration of ``pretrain_vlm.py FLAGS`` (:func:`run_vlm`)."""
    from tests.e2e.conftest import losses_and_validation

    return losses_and_validation(run_vlm(flags, nproc).stdout)[0]
