"""The LLaVA family through the trainer (in this process, CPU): Megatron's flags become one LlavaConfig,
frozen parts (``--freeze-LM``, ``--freeze-ViT``, ``--freeze-vision-projection``) get no gradients and no
optimizer state and are bitwise unchanged by steps, the trained parts change, and what is not built is
refused with one line naming the flag."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from PIL import Image

from megatrain.models.registry import get_family
from megatrain.training.main import parse_family_args
from megatrain.training.trainer import Trainer
from tests.unit.test_multimodal_data import write_tokenizer

COLORS = {"red": ((220, 30, 30), "a red bus ."), "blue": ((30, 30, 220), "a cat ."), "green": ((30, 200, 30), "a dog .")}


def write_llava_data(root: Path, n: int = 24, seed: int = 0) -> dict[str, str]:
    """A tokenizer with ``<image>`` and a LLaVA jsonl of ``n`` lines: solid-colour images (PIL, odd
    sizes) whose colour decides the answer, every sixth line text only."""
    tok = write_tokenizer(root / "tok", True)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    with open(root / "d.jsonl", "w") as f:
        for k in range(n):
            if k % 6 == 5:
                f.write(json.dumps({"id": str(k), "conversations": [{"from": "human", "value": "hello"},
                                                                    {"from": "gpt", "value": "hi ."}]}) + "\n")
                continue
            rgb, answer = COLORS[rng.choice(sorted(COLORS))]
            color = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in rgb)
            Image.new("RGB", (20 + k % 5, 18 + k % 3), color).save(images / f"{k}.png")
            f.write(json.dumps({"id": str(k), "image": f"{k}.png", "conversations": [
                {"from": "human", "value": "<image>\nwhat is this ?"}, {"from": "gpt", "value": answer}]}) + "\n")
    return {"tok": tok, "data": str(root / "d.jsonl"), "images": str(images)}


def vlm_args(paths: dict[str, str]) -> list[str]:
    """A tiny LLaVA: 2-layer GPT (h 32), a 1-layer CLIP ViT (h 32) on 16 x 16 images of 8-pixel patches."""
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", paths["tok"],
            "--data-path", paths["data"], "--image-folder", paths["images"],
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "64", "--vision-num-layers", "1", "--vision-hidden-size", "32",
            "--vision-num-attention-heads", "4", "--vision-ffn-hidden-size", "64", "--patch-dim", "8",
            "--img-h", "16", "--img-w", "16", "--disable-vision-class-token", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--make-vocab-size-divisible-by", "8", "--lr", "1e-2",
            "--lr-decay-style", "constant", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            # logits with some range from the start, so a projector alone (stage 1) can move the loss
            "--init-method-std", "0.2"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return write_llava_data(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(autouse=True)
def _one_process():
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)


PARTS = ("language_model.", "vision_model.", "projector.")


@pytest.mark.parametrize("freeze,trained", [(["--freeze-LM", "--freeze-ViT"], {"projector."}),
                                            (["--freeze-ViT"], {"projector.", "language_model."}),
                                            (["--freeze-vision-projection"], {"language_model.", "vision_model."})],
                         ids=["stage1", "stage2", "frozen_projector"])
def test_frozen_parts_have_no_gradients_no_optimizer_state_and_do_not_change(paths, freeze, trained):
    args = parse_family_args("llava", [*vlm_args(paths), *freeze, "--train-iters", "3"], prog="pretrain_vlm.py")
    t = Trainer(args, family="llava")
    cfg = t.model_config
    assert (cfg.freeze_language_model, cfg.freeze_vision_model, cfg.freeze_projector) == (
        "language_model." not in trained, "vision_model." not in trained, "projector." not in trained)
    # the log line's FLOPs: the language model over the expanded positions (the text's placeholder
    # standing for the image's tokens), the parts as autograd runs them frozen
    from megatrain.models.llava.flops import num_floating_point_operations

    positions = args.seq_length - 1 + cfg.tokens_per_image
    assert t.flops_per_iteration == num_floating_point_operations(cfg, args.global_batch_size, positions)
    before = {k: v.detach().clone() for k, v in t.module.named_parameters()}
    in_optimizer = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    for name, p in t.module.named_parameters():
        part = next(x for x in PARTS if name.startswith(x))
        assert p.requires_grad == (part in trained), name
        assert (id(p) in in_optimizer) == (part in trained), name
    t.train()
    t.close()
    after = dict(t.module.named_parameters())
    for name, p in after.items():
        part = next(x for x in PARTS if name.startswith(x))
        if part not in trained:
            assert p.grad is None and p not in t.optimizer.state, name
            assert torch.equal(p.detach(), before[name]), f"{name} changed although frozen"
    for part in trained:  # every trained part moved
        assert any(not torch.equal(after[n].detach(), before[n]) for n in before if n.startswith(part)), part


def test_the_chunked_loss_head_computes_the_labeled_rows_alone(paths):
    """LLaVA's labels are answer-only (LlavaObjective.sparse_labels): with the chunked loss head the trainer
    has it compute the labeled rows alone, and training runs through it; pre-training GPT keeps every row."""
    from megatrain.runtime.fused_loss import ChunkedCrossEntropy

    args = parse_family_args("llava", [*vlm_args(paths), "--freeze-ViT", "--train-iters", "2",
                                       "--cross-entropy-chunk-size", "16"], prog="pretrain_vlm.py")
    t = Trainer(args, family="llava")
    head = t.module.loss_head
    assert isinstance(head, ChunkedCrossEntropy) and head.labeled_rows_only
    t.train()
    t.close()
    assert t.last_result is not None and all(torch.isfinite(torch.as_tensor(v)).all()
                                             for v in t.last_result[1].losses.values())


@pytest.mark.parametrize("extra,line", [
    (["--context-parallel-size", "2"], "--context-parallel-size > 1 is not supported for the LLaVA family"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size > 1 is not supported for the LLaVA family"),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"],
     "--num-virtual-stages-per-pipeline-rank: the LLaVA family (pretrain_vlm.py) runs one pipeline stage per rank"),
    (["--use-tiling"], "--use-tiling: not supported by pretrain_vlm.py (image tiling"),
    (["--num-frames", "8"], "--num-frames 8: not supported by pretrain_vlm.py (video"),
    (["--image-tag-type", "nvlm"], "--image-tag-type nvlm: not supported"),
    (["--vision-model-type", "siglip"], "--vision-model-type siglip: only clip"),
    (["--img-h", "18"], "--img-h (18) must be a multiple of --patch-dim (8)"),
    (["--max-position-embeddings", "32"], "--max-position-embeddings (32) must cover --seq-length (32)"),
    (["--freeze-LM", "--freeze-ViT", "--freeze-vision-projection"], "every part is frozen"),
    (["--encoder-pipeline-model-parallel-size", "2"], "--encoder-pipeline-model-parallel-size 2: the vision encoder"),
    (["--encoder-tensor-model-parallel-size", "2"], "--encoder-tensor-model-parallel-size 2: at most "
                                                     "--tensor-model-parallel-size (1)"),
    (["--encoder-pipeline-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "1"], "--decoder-first-pipeline-num-layers must then be left out"),
    (["--tokenizer-type", "MultimodalTokenizer", "--tokenizer-prompt-format", "nvlm-yi-34b"],
     "--tokenizer-type MultimodalTokenizer --tokenizer-prompt-format nvlm-yi-34b: megatrain's prompt formats"),
])
def test_refused_flags_are_one_line_naming_the_flag(paths, extra, line):
    with pytest.raises(SystemExit) as e:
        parse_family_args("llava", [*vlm_args(paths), *extra, "--train-iters", "1"], prog="pretrain_vlm.py")
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message and line in message, message


@pytest.mark.parametrize("freeze", [["--freeze-LM"], ["--freeze-LM", "--freeze-ViT"]])
def test_freezing_the_language_model_under_pipeline_parallelism_is_accepted(paths, monkeypatch, freeze):
    """Megatron's projector pre-training under PP: the stages after the first hold only frozen
    language-model layers and take part with an optimizer that updates nothing
    (tests/distributed/test_llava_pipeline.py trains it)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_family_args("llava", [*vlm_args(paths), "--pipeline-model-parallel-size", "2", *freeze,
                                       "--train-iters", "1"], prog="pretrain_vlm.py")
    cfg = get_family("llava").config_from_args(args, 64)
    assert cfg.freeze_language_model and cfg.freeze_vision_model == ("--freeze-ViT" in freeze)


def test_everything_frozen_under_pipeline_parallelism_is_one_line_naming_the_flags(paths, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        parse_family_args("llava", [*vlm_args(paths), "--pipeline-model-parallel-size", "2", "--freeze-LM",
                                    "--freeze-ViT", "--freeze-vision-projection", "--train-iters", "1"],
                          prog="pretrain_vlm.py")
    assert str(e.value) == ("error: --freeze-LM --freeze-ViT --freeze-vision-projection: every part is frozen, "
                            "nothing would train")


def test_megatron_names_are_mapped(paths):
    args = parse_family_args("llava", [*vlm_args(paths), "--dataloader-type", "external", "--language-model-type",
                                       "mistral_7b", "--train-iters", "1"], prog="pretrain_vlm.py")
    assert args.dataloader_type == "single"
    cfg = get_family("llava").config_from_args(args, 64)  # the config, as the trainer builds it
    assert cfg.tokens_per_image == 4 and cfg.disable_vision_class_token and cfg.vision.patch_dim == 8
    assert cfg.language.num_layers == 2 and cfg.vision.num_layers == 1 and cfg.projector_type == "mlp"


def test_checkpoint_config_checks_compare_the_shape_not_the_frozen_parts(paths):
    from megatrain.checkpoint import config_differences

    family = get_family("llava")
    stage1 = family.config_from_args(parse_family_args("llava", [*vlm_args(paths), "--freeze-LM", "--freeze-ViT",
                                                                 "--train-iters", "1"]), 64)
    saved = json.loads(json.dumps(stage1.to_dict()))  # as meta.json holds it
    stage2 = family.config_from_args(parse_family_args("llava", [*vlm_args(paths), "--freeze-ViT",
                                                                 "--train-iters", "1"]), 64)
    assert config_differences(saved, stage2) == []
    other = family.config_from_args(parse_family_args("llava", [*vlm_args(paths), "--vision-num-layers", "2",
                                                                "--train-iters", "1"]), 64)
    (line,) = config_differences(saved, other)
    assert line == ("the vision encoder's flags (--vision-num-layers, --img-h, --patch-dim, ...): checkpoint "
                    "{'num_layers': 1}, flags {'num_layers': 2}")


def test_an_error_in_a_loader_worker_is_its_own_line():
    from megatrain.errors import loader_worker_message

    text = ("Caught MultimodalDataError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
            '  File "x.py", line 1, in f\nmegatrain.data.multimodal.errors.MultimodalDataError: --data-path d.jsonl:4: '
            "image x.png: no such file\n")
    assert loader_worker_message(text) == "--data-path d.jsonl:4: image x.png: no such file"
    assert loader_worker_message("plain: message") == "plain: message"


def test_megatrons_separate_encoder_stage_is_one_more_pipeline_stage(paths, monkeypatch):
    """``--encoder-pipeline-model-parallel-size 1`` (Megatron's LLaVA layout): the encoder and projector on
    a stage of their own before the language model's stages; the encoder's tensor-parallel size accepted
    up to the model's (the encoder is replicated)."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    args = parse_family_args("llava", [*vlm_args(paths), "--pipeline-model-parallel-size", "2",
                                       "--encoder-pipeline-model-parallel-size", "1",
                                       "--encoder-tensor-model-parallel-size", "1", "--train-iters", "1"],
                             prog="pretrain_vlm.py")
    assert args.pipeline_model_parallel_size == 3 and args.decoder_first_pipeline_num_layers == 0
    assert args.encoder_pipeline_model_parallel_size == 0
    from megatrain.parallel.pipeline import split_layers

    assert [len(s) for s in split_layers(args.num_layers, 3, first=0)] == [0] + [args.num_layers // 2] * 2


def test_the_encoder_layout_flags_are_refused_outside_pretrain_vlm(capsys):
    from tests.unit.test_arguments import fails

    message = fails(capsys, "--encoder-pipeline-model-parallel-size", "1")
    assert "--encoder-pipeline-model-parallel-size: only pretrain_vlm.py has a separate encoder" in message
