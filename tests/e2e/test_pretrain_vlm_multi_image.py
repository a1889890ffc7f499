"""``pretrain_vlm.py`` on a LLaVA jsonl whose lines mix two-image samples (``"image": [a, b]``, one
``<image>`` per image), one-image and text-only samples: the real entry point trains on them."""

from __future__ import annotations

import math
import sys

from tests.e2e.conftest import cpu_env, run_cmd
from tests.e2e.vlm_helpers import with_two_image_lines
from tests.unit.test_llava_family import vlm_args, write_llava_data


def test_pretrain_vlm_trains_on_two_image_samples(tmp_path):
    paths = write_llava_data(tmp_path, n=8)
    rows = with_two_image_lines(paths, range(0, 8, 2))  # every other line (8: every sample of the 2 x 8 is read)
    assert sum(isinstance(r.get("image"), list) for r in rows) == 4 and any("image" not in r for r in rows)
    run = run_cmd([sys.executable, "pretrain_vlm.py", *vlm_args(paths), "--freeze-ViT", "--train-iters", "2"],
                  env=cpu_env())
    from megatrain.training.logging import parse_train_log_line

    logs = [parse_train_log_line(x) for x in run.stdout.splitlines() if "] iteration " in x]
    assert [d["iteration"] for d in logs] == [1, 2], run.stdout[-2000:]
    assert all(math.isfinite(d["lm loss"]) for d in logs), logs
