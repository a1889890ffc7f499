"""``pretrain_vlm.py`` end to end on CPU: a tiny LLaVA (2-layer GPT, 1-layer CLIP ViT) on a LLaVA jsonl file
with PIL-made images and an offline tokenizer.

Stage 1 (``--freeze-LM --freeze-ViT``: the projector only) then stage 2 (``--freeze-ViT``: SFT of the
language model and projector from stage 1's checkpoint, ``--pretrained-checkpoint``): the loss falls in
both, the frozen parts are bitwise the initial (stage 1) or stage 1's (stage 2) weights, a stage-2 run
stopped and resumed gives the uninterrupted run's losses, DP=2 under torchrun gives one process's losses
(fp32), validation and TensorBoard work, and a bad flag or a bad jsonl line is one line naming it."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from tests.e2e.conftest import cpu_env, run_cmd
from tests.unit.test_llava_family import vlm_args, write_llava_data


def _train(stdout: str) -> list[dict]:
    from megatrain.training.logging import parse_train_log_line

    return [parse_train_log_line(x) for x in stdout.splitlines() if "] iteration " in x]


def _losses(stdout: str) -> list[float]:
    return [d["lm loss"] for d in _train(stdout)]


def _vlm(flags: list[str], nproc: int = 1, check: bool = True):
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc-per-node={nproc}"]
    return run_cmd([*launch, "pretrain_vlm.py", *flags], env=cpu_env(), check=check)


def _weights(ckpt: str, step: int) -> dict[str, torch.Tensor]:
    from megatrain.inference.loading import load_model

    model, _ = load_model(ckpt, torch.device("cpu"), step)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """Stage 1 (8 iterations) and stage 2 from it (6 iterations, validation, TensorBoard)."""
    out = tmp_path_factory.mktemp("vlm_stages")
    paths = write_llava_data(out)
    base = vlm_args(paths)
    stage1 = _vlm([*base, "--freeze-LM", "--freeze-ViT", "--lr", "3e-2", "--train-iters", "8",
                   "--save", str(out / "s1"), "--save-interval", "8"])
    stage2_flags = [*base, "--freeze-ViT", "--pretrained-checkpoint", str(out / "s1"), "--train-iters", "6",
                    "--valid-data-path", paths["data"], "--eval-interval", "3", "--eval-iters", "1"]
    stage2 = _vlm([*stage2_flags, "--save", str(out / "s2"), "--save-interval", "6",
                   "--tensorboard-dir", str(out / "tb")])
    return {"out": out, "paths": paths, "stage1": stage1.stdout, "stage2": stage2.stdout, "flags": stage2_flags}


def test_stage1_trains_the_projector_only(stages):
    losses = _losses(stages["stage1"])
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses
    from megatrain.models.llava import initial_value
    from megatrain.checkpoint import checkpoint_model_config, find_checkpoint, read_meta

    ckpt = find_checkpoint(str(stages["out"] / "s1"))
    cfg = checkpoint_model_config(ckpt, read_meta(ckpt))
    assert cfg.freeze_language_model and cfg.freeze_vision_model and not cfg.freeze_projector
    weights = _weights(str(stages["out"] / "s1"), 8)
    for name, value in weights.items():
        if name.startswith(("language_model.", "vision_model.")):  # the initialisation, bit for bit (--seed 1234)
            assert torch.equal(value, initial_value(name, value.shape, cfg, 1234)), name
    assert any(not torch.equal(v, initial_value(n, v.shape, cfg, 1234)) for n, v in weights.items()
               if n.startswith("projector."))


def test_stage2_loads_stage1_and_keeps_the_vit(stages):
    stdout = stages["stage2"]
    assert "loaded checkpoint from" in stdout and "finetune" in stdout
    losses = _losses(stdout)
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses
    assert "validation loss at iteration 3" in stdout and "validation loss at iteration 6" in stdout
    s1, s2 = _weights(str(stages["out"] / "s1"), 8), _weights(str(stages["out"] / "s2"), 6)
    for name in s1:
        if name.startswith("vision_model."):
            assert torch.equal(s1[name], s2[name]), f"{name} changed in stage 2 (--freeze-ViT)"
    for part in ("language_model.", "projector."):
        assert any(not torch.equal(s1[n], s2[n]) for n in s1 if n.startswith(part)), part
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(stages["out"] / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "lm loss" in tags and any("validation" in t and "lm loss" in t for t in tags), sorted(tags)


def test_stage2_resumes_exactly(stages, tmp_path):
    flags = stages["flags"]
    first = _vlm([*flags, "--save", str(tmp_path / "ckpt"), "--exit-interval", "3"])
    assert [d["iteration"] for d in _train(first.stdout)] == [1, 2, 3]
    rest = _vlm([*flags, "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")])
    assert [d["iteration"] for d in _train(rest.stdout)] == [4, 5, 6]
    assert _losses(first.stdout) + _losses(rest.stdout) == _losses(stages["stage2"])


def test_data_parallel_2_equals_one_process(stages):
    dp2 = _vlm(stages["flags"], nproc=2)
    one, two = _train(stages["stage2"]), _train(dp2.stdout)
    assert len(one) == len(two) == 6
    for a, b in zip(one, two):
        assert b["lm loss"] == pytest.approx(a["lm loss"], rel=1e-5, abs=1e-5), (one, two)
        assert b["grad norm"] == pytest.approx(a["grad norm"], rel=1e-4, abs=1e-4), (one, two)


def test_a_bad_flag_and_a_bad_line_are_one_line(stages, tmp_path):
    base = vlm_args(stages["paths"])
    bad = _vlm([*base, "--freeze-lm", "--train-iters", "1"], check=False)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].endswith("unknown flag --freeze-lm (did you mean --freeze-LM?)")
    # (the refusals of what is not built: tests/unit/test_llava_family.py, through the same parser)

    data = tmp_path / "bad.jsonl"
    lines = open(stages["paths"]["data"]).read().splitlines()
    lines[3] = json.dumps({"id": "x", "image": "missing.png", "conversations": [
        {"from": "human", "value": "<image>\nwhat"}, {"from": "gpt", "value": "a ."}]})
    data.write_text("\n".join(lines) + "\n")
    flags = [f if f != stages["paths"]["data"] else str(data) for f in base]
    missing = _vlm([*flags, "--train-iters", "3", "--num-workers", "1"], check=False)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr, missing.stderr[-2000:]
    assert missing.stderr.strip().splitlines()[-1] == (
        f"error: --data-path {data}:4: image {stages['paths']['images']}/missing.png: no such file")


def test_an_energon_dataset_folder_trains(tmp_path):
    """``--data-path DIR`` of an energon dataset (webdataset shards, ``.nv-meta``), Megatron's
    ``--dataloader-type external``: megatrain's loader reads energon's seeded stream."""
    pytest.importorskip("megatron.energon")
    from tests.e2e.vlm_helpers import energon_vqa_flags

    flags = energon_vqa_flags(tmp_path)
    run = _vlm([*flags, "--freeze-ViT", "--dataloader-type", "external", "--train-iters", "4"])
    losses = _losses(run.stdout)
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert "--dataloader-type external: megatrain's loader reads the dataset" in run.stdout + run.stderr


@pytest.mark.long  # a GPT checkpoint and a CLIP folder converted before the run: the slowest of these
def test_parts_start_from_a_gpt_checkpoint_and_a_clip_folder(stages, tmp_path):
    """``--language-model-checkpoint`` (a pretrain_gpt.py checkpoint) and ``--vision-model-checkpoint`` (a
    Hugging Face CLIPVisionModel folder): stage 1 starts from both, and keeps them bit for bit (frozen)."""
    transformers = pytest.importorskip("transformers")
    from megatrain.convert.import_hf import read_hf_config, read_hf_weights
    from megatrain.models.llava.hf import vision_encoder_from_hf

    base = vlm_args(stages["paths"])
    torch.manual_seed(0)
    transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16,
        patch_size=8)).save_pretrained(str(tmp_path / "clip"))
    model_flags = base[base.index("--num-layers"):base.index("--vision-num-layers")]
    run_cmd([sys.executable, "pretrain_gpt.py", "--mock-data", *base[:4], *model_flags, "--micro-batch-size", "2",
             "--global-batch-size", "8", "--make-vocab-size-divisible-by", "8", "--lr", "1e-2", "--train-iters", "2",
             "--eval-iters", "0", "--init-method-std", "0.2", "--save", str(tmp_path / "gpt"), "--save-interval", "2"],
            env=cpu_env())
    run = _vlm([*base, "--freeze-LM", "--freeze-ViT", "--train-iters", "2", "--save", str(tmp_path / "vlm"),
                "--save-interval", "2", "--language-model-checkpoint", str(tmp_path / "gpt"),
                "--vision-model-checkpoint", str(tmp_path / "clip")])
    assert " loaded language_model from --language-model-checkpoint " in run.stdout
    assert f" loaded vision_model from --vision-model-checkpoint {tmp_path / 'clip'}" in run.stdout
    from megatrain.inference.loading import load_model

    gpt, _ = load_model(str(tmp_path / "gpt"), torch.device("cpu"))
    vit = vision_encoder_from_hf(read_hf_config(str(tmp_path / "clip")), read_hf_weights(str(tmp_path / "clip")))
    trained = _weights(str(tmp_path / "vlm"), 2)
    for prefix, part in (("language_model.", gpt), ("vision_model.", vit)):
        own = part.state_dict()
        names = [n for n in trained if n.startswith(prefix)]
        assert names and all(torch.equal(trained[n], own[n[len(prefix):]]) for n in names), prefix
