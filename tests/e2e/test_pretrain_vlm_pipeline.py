"""``pretrain_vlm.py --pipeline-model-parallel-size 2`` through the real entry point equals one process
(fp32, CPU, gloo under torchrun), and its checkpoint loads in one process.

The tiny LLaVA of tests/unit/test_llava_family.py on its jsonl (one-image lines, every sixth line text
only) with two-image lines added: in one process and under ``torchrun --nproc-per-node 2
--pipeline-model-parallel-size 2`` (the vision encoder and projector on the first stage, one language
layer on each) the logged losses and gradient norms agree to 1e-5. A checkpoint saved under PP=2 holds
the one-process model's parameters under their canonical names and resumes in one process with one
process's losses. (The exact comparison of parameters: tests/distributed/test_llava_pipeline.py.)
"""

from __future__ import annotations

import json

import pytest
from PIL import Image

from tests.e2e.vlm_helpers import run_losses, same_checkpoint_parameters, same_losses
from tests.unit.test_llava_family import COLORS, vlm_args, write_llava_data

PP2 = ["--pipeline-model-parallel-size", "2"]


def _data(root):
    paths = write_llava_data(root)
    rows = [json.loads(x) for x in open(paths["data"])]
    names = sorted(COLORS)
    for k in range(1, len(rows), 4):  # two images on every fourth line
        if "image" not in rows[k]:
            continue
        Image.new("RGB", (19, 17), COLORS[names[k % 3]][0]).save(f"{paths['images']}/m{k}.png")
        rows[k]["image"] = [rows[k]["image"], f"m{k}.png"]
        rows[k]["conversations"][0]["value"] = "<image>\n<image>\nwhat is this ?"
    with open(paths["data"], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return paths


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (6 iterations, saved at 4) and PP=2 (the first 4 of the same 6, saved at 4)."""
    out = tmp_path_factory.mktemp("vlm_pp")
    paths = _data(out)
    one = run_losses([*vlm_args(paths), "--train-iters", "6", "--save", str(out / "one"), "--save-interval", "4"])
    pp2 = run_losses([*vlm_args(paths), *PP2, "--train-iters", "6", "--exit-interval", "4", "--save", str(out / "pp2"),
                "--save-interval", "4"], nproc=2)
    return {"out": out, "paths": paths, "one": one, "pp2": pp2}


def test_the_data_has_two_image_and_text_only_lines(runs):
    rows = [json.loads(x) for x in open(runs["paths"]["data"])]
    assert any(isinstance(r.get("image"), list) for r in rows) and any("image" not in r for r in rows)


def test_pipeline_parallel_2_equals_one_process(runs):
    same_losses(runs["one"][:4], runs["pp2"])


def test_a_pipeline_checkpoint_loads_and_resumes_in_one_process(runs):
    same_checkpoint_parameters(str(runs["out"] / "one"), str(runs["out"] / "pp2"), 4)
    resumed = run_losses([*vlm_args(runs["paths"]), "--train-iters", "6", "--load", str(runs["out"] / "pp2")])
    same_losses(runs["one"][4:], resumed)
