"""``pretrain_vlm.py`` on a LLaVA jsonl whose lines mix two-image samples (``"image": [a, b]``, one
``<image>`` per image), one-image and text-only samples: the real entry point trains on them."""

from __future__ import annotations

import json
import math
import sys

from PIL import Image

from tests.e2e.conftest import cpu_env, run_cmd
from tests.unit.test_llava_family import COLORS, vlm_args, write_llava_data


def test_pretrain_vlm_trains_on_two_image_samples(tmp_path):
    paths = write_llava_data(tmp_path, n=8)
    rows = [json.loads(x) for x in open(paths["data"])]
    names = sorted(COLORS)
    for k in range(0, 8, 2):  # every other line: two images (8 lines: every sample of the 2 x 8 is read)
        rgb, answer = COLORS[names[(k + 1) % 3]]  # the answer from the second image
        Image.new("RGB", (19, 17), COLORS[names[k % 3]][0]).save(f"{paths['images']}/m{k}a.png")
        Image.new("RGB", (21, 16), rgb).save(f"{paths['images']}/m{k}b.png")
        rows[k] = {"id": f"m{k}", "image": [f"m{k}a.png", f"m{k}b.png"], "conversations": [
            {"from": "human", "value": "<image>\n<image>\nwhat is this ?"}, {"from": "gpt", "value": answer}]}
    with open(paths["data"], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert sum(isinstance(r.get("image"), list) for r in rows) == 4 and any("image" not in r for r in rows)
    run = run_cmd([sys.executable, "pretrain_vlm.py", *vlm_args(paths), "--freeze-ViT", "--train-iters", "2"],
                  env=cpu_env())
    from megatrain.training.logging import parse_train_log_line

    logs = [parse_train_log_line(x) for x in run.stdout.splitlines() if "] iteration " in x]
    assert [d["iteration"] for d in logs] == [1, 2], run.stdout[-2000:]
    assert all(math.isfinite(d["lm loss"]) for d in logs), logs
