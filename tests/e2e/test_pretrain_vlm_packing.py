"""``pretrain_vlm.py --packing-buffer-size B --packing-seq-length P`` end to end on CPU (the tiny LLaVA of
``tests/unit/test_llava_family.py``): packed rows of text-only, one-image and two-image samples train, a run
stopped and resumed gives the uninterrupted run's losses, one-sample buffers give the unpacked run's losses,
an energon folder packs too, and a bad flag or a sample that cannot be cut to P is one line."""

from __future__ import annotations

import math

import pytest

from tests.e2e.vlm_helpers import energon_vqa_flags, losses, run_vlm, train_lines, with_two_image_lines
from tests.unit.test_llava_family import vlm_args, write_llava_data

PACK = ["--packing-buffer-size", "8", "--packing-seq-length", "64"]
_train, _losses = train_lines, losses


def _vlm(flags: list[str], check: bool = True):
    return run_vlm(flags, check=check)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """The family's test data with every fourth line a two-image sample."""
    paths = write_llava_data(tmp_path_factory.mktemp("vlm_pack"), n=24)
    with_two_image_lines(paths, range(0, 24, 4))
    return paths


@pytest.fixture(scope="module")
def packed_run(paths):
    flags = [*vlm_args(paths), *PACK, "--freeze-ViT", "--train-iters", "4"]
    return {"flags": flags, "stdout": _vlm(flags).stdout}


def test_packed_rows_train(packed_run):
    logs = _train(packed_run["stdout"])
    assert [d["iteration"] for d in logs] == [1, 2, 3, 4], packed_run["stdout"][-2000:]
    assert all(math.isfinite(d["lm loss"]) for d in logs), logs
    assert logs[-1]["lm loss"] < logs[0]["lm loss"], logs


def test_packed_run_resumes_exactly(packed_run, tmp_path):
    flags = packed_run["flags"]
    first = _vlm([*flags, "--save", str(tmp_path / "ckpt"), "--save-interval", "2", "--exit-interval", "2"])
    assert [d["iteration"] for d in _train(first.stdout)] == [1, 2]
    rest = _vlm([*flags, "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")])
    assert [d["iteration"] for d in _train(rest.stdout)] == [3, 4]
    assert _losses(first.stdout) + _losses(rest.stdout) == _losses(packed_run["stdout"])


def test_one_sample_buffers_equal_the_unpacked_run(paths):
    base = [*vlm_args(paths), "--freeze-ViT", "--train-iters", "2"]
    unpacked = _losses(_vlm(base).stdout)
    single = _losses(_vlm([*base, "--packing-buffer-size", "1", "--packing-seq-length", "64"]).stdout)
    assert len(unpacked) == len(single) == 2
    assert single == pytest.approx(unpacked, rel=1e-6, abs=1e-6), (single, unpacked)


def test_bad_packing_flags_and_an_uncuttable_sample_are_one_line(paths):
    base = [*vlm_args(paths), "--train-iters", "1"]
    bad = _vlm([*base, "--packing-buffer-size", "8"], check=False)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert bad.stderr.strip().splitlines()[-1] == (
        "error: --packing-buffer-size 8 needs --packing-seq-length (the positions of a packed row, at least 2), got 0")
    # 6 positions: an image sample keeps its prompt and image only, no answer token
    short = _vlm([*base, "--packing-buffer-size", "8", "--packing-seq-length", "6"], check=False)
    assert short.returncode != 0 and "Traceback" not in short.stderr, short.stderr[-2000:]
    last = short.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --data-path {paths['data']}:") and "--packing-seq-length 6" in last, last


def test_an_energon_folder_packs(tmp_path):
    pytest.importorskip("megatron.energon")
    flags = energon_vqa_flags(tmp_path)
    run = _vlm([*flags, *PACK, "--freeze-ViT", "--train-iters", "3"])
    losses = _losses(run.stdout)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
