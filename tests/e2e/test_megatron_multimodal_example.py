"""Megatron-LM's ``examples/multimodal/pretrain_mistral_clip.sh`` through ``examples/multimodal/train.py``
on CPU: every flag of the script, the shapes shrunk (layers, hidden, heads, ffn, sequence, image and patch
size, the ViT's size through megatrain's ``--vision-*`` flags; TP 1, a few iterations) and the paths
pointing at this test's files: an energon metadataset (``pretrain_dataset.yaml``'s layout: a train and a
val split, each naming an energon dataset folder relative to the yaml) for ``--data-path`` and
``--valid-path``, a Hugging Face tokenizer folder for ``--tokenizer-type MistralTokenizer``. The run
trains (a finite ``lm loss``), validates on the val split, saves, and a rerun resumes from the checkpoint
(the script's ``--load`` = ``--save``) to the uninterrupted run's losses.

``--pretrained-checkpoint`` is left out (there is no combined Megatron checkpoint to start from; the
run starts from its initialisation). ``--use-checkpoint-args`` stays: on the first run ``--load`` is empty
and the flags set the shape (as in Megatron); the rerun takes the language model's and the ViT's shape from
the LLaVA checkpoint's config."""

from __future__ import annotations

import math
import random
import sys

import pytest
from PIL import Image

from tests.e2e.conftest import cpu_env, run_cmd
from tests.unit.test_llava_family import COLORS, write_llava_data

METADATASET = """__module__: megatron.energon
__class__: Metadataset
splits:
  train:
    datasets:
      - weight: 1.
        path: {train}
        subflavors:
          augmentation: false
  val:
    datasets:
      - weight: 1.
        path: {val}
        subflavors:
          augmentation: false
"""


def _train(stdout: str) -> list[dict]:
    from megatrain.training.logging import parse_train_log_line

    return [parse_train_log_line(x) for x in stdout.splitlines() if "] iteration " in x]


def _run(flags: list[str], check: bool = True):
    return run_cmd([sys.executable, "examples/multimodal/train.py", *flags], env=cpu_env(), check=check)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The tokenizer folder, two energon datasets (12 training samples; 4 in a val split) and the
    metadataset naming them."""
    pytest.importorskip("megatron.energon")
    from megatrain.data.multimodal import energon as mm_energon
    from tests.unit.test_multimodal_data import write_shards

    root = tmp_path_factory.mktemp("mistral_clip")
    tok = write_llava_data(root / "tok", n=1)["tok"]
    rng = random.Random(3)
    items = []
    for k in range(16):
        rgb, answer = COLORS[rng.choice(sorted(COLORS))]
        items.append((f"{k:06d}", Image.new("RGB", (20 + k % 3, 18), rgb),
                      {"question": "what is this ?", "answers": [answer]}))
    for name, part, ratio in (("train", items[:12], (1.0, 0.0, 0.0)), ("validation", items[12:], (0.0, 1.0, 0.0))):
        folder = root / "data" / name / "dataset"
        folder.mkdir(parents=True)
        mm_energon.prepare_dataset(str(folder), write_shards(folder, part, per_shard=4), "VQASample",
                                   {"image": "jpg", "context": "json[question]", "answers": "json[answers]"},
                                   split_ratio=ratio)
    yaml = root / "pretrain_dataset.yaml"
    yaml.write_text(METADATASET.format(train="data/train/dataset", val="data/validation/dataset"))
    (root / "manual_prompts.json").write_text('{"Captions": {"raw": ["Describe the image."]}}')
    return {"root": root, "tok": tok, "yaml": str(yaml)}


def script_flags(ws: dict, out: str, train_iters: int = 4) -> list[str]:
    """pretrain_mistral_clip.sh's OPTIONS, in its order, shapes shrunk, paths the test's."""
    ckpt = f"{out}/checkpoints"
    return [
        "--img-embedding-idx", "1", "--apply-layernorm-1p", "--attention-softmax-in-fp32", "--use-checkpoint-args",
        "--use-distributed-optimizer", "--transformer-impl", "transformer_engine", "--use-te",
        "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups", "2",
        "--no-masked-softmax-fusion", "--num-workers", "0", "--exit-duration-in-mins", "230", "--use-flash-attn",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--position-embedding-type", "rope",
        "--rotary-percent", "1.0", "--rotary-base", "1000000", "--swiglu", "--attention-dropout", "0.0",
        # the script's HD=0.1: the resumed run's dropout masks are the uninterrupted run's too
        "--hidden-dropout", "0.1", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "64", "--ffn-hidden-size", "64", "--train-iters", str(train_iters),
        "--micro-batch-size", "1", "--global-batch-size", "2", "--lr-decay-iters", str(train_iters),
        "--lr-warmup-fraction", ".01", "--lr", "0.00015", "--min-lr", "1.0e-5", "--lr-decay-style", "cosine",
        "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "2",
        "--tokenizer-type", "MistralTokenizer", "--tokenizer-model", ws["tok"],
        "--data-path", ws["yaml"], "--valid-path", ws["yaml"],
        "--prompt-path", str(ws["root"] / "manual_prompts.json"), "--save-interval", "2",
        "--save", ckpt, "--load", ckpt, "--dataloader-save", f"{ckpt}/dataloader",
        "--split", "100,0,0", "--clip-grad", "1.0", "--weight-decay", "1e-2", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--init-method-std", "0.014", "--log-params-norm", "--log-num-zeros-in-grad",
        "--bf16", "--eod-mask-loss", "--freeze-LM", "--freeze-ViT", "--patch-dim", "8", "--img-h", "16",
        "--img-w", "16", "--dataloader-type", "external", "--tensorboard-dir", f"{out}/tensorboard",
        "--language-model-type=mistral_7b", "--disable-vision-class-token", "--distributed-timeout-minutes", "60",
        "--allow-missing-vision-projection-checkpoint",
        # megatrain's: the ViT's size (Megatron fixes it by --vision-model-type clip), shrunk too
        "--vision-num-layers", "1", "--vision-hidden-size", "32", "--vision-num-attention-heads", "4",
        "--vision-ffn-hidden-size", "64", "--make-vocab-size-divisible-by", "8",
    ]


@pytest.fixture(scope="module")
def runs(workspace, tmp_path_factory):
    out = tmp_path_factory.mktemp("mistral_clip_out")
    whole = _run(script_flags(workspace, str(out / "whole")))
    first = _run([*script_flags(workspace, str(out / "resumed")), "--exit-interval", "2"])
    rest = _run(script_flags(workspace, str(out / "resumed")))
    return {"whole": whole, "first": first, "rest": rest, "out": out}


def test_the_script_trains_and_validates_on_the_val_split(runs, workspace):
    stdout = runs["whole"].stdout
    logs = _train(stdout)
    assert [d["iteration"] for d in logs] == [1, 2, 3, 4], stdout[-3000:]
    assert all(math.isfinite(d["lm loss"]) for d in logs), logs
    # the val split of the metadataset (its validation folder's 4 samples), read through --valid-path
    assert (f"note: validation reads the val split of --valid-path {workspace['yaml']} (4 samples, in order, "
            "unshuffled)") in stdout, stdout[-3000:]
    for it in (2, 4):
        assert f"validation loss at iteration {it} | lm loss value: " in stdout, stdout[-3000:]
    assert "note: --img-embedding-idx 1: ignored" in stdout
    assert "note: --tokenizer-type MistralTokenizer: read as HuggingFaceTokenizer" in stdout
    assert "Traceback" not in runs["whole"].stderr, runs["whole"].stderr[-3000:]


def test_a_rerun_resumes_from_the_checkpoint(runs):
    first, rest = _train(runs["first"].stdout), _train(runs["rest"].stdout)
    assert [d["iteration"] for d in first] == [1, 2], runs["first"].stdout[-3000:]
    assert [d["iteration"] for d in rest] == [3, 4], runs["rest"].stdout[-3000:]
    whole = [d["lm loss"] for d in _train(runs["whole"].stdout)]
    assert [d["lm loss"] for d in first + rest] == pytest.approx(whole, rel=1e-5), (first, rest, whole)


def test_use_checkpoint_args_resumes(runs, workspace, tmp_path):
    import shutil

    ckpt = tmp_path / "out"
    shutil.copytree(runs["out"] / "resumed", ckpt)
    # two iterations more, on the checkpoint's schedule, with shape flags that differ from the checkpoint's
    # (the language model's query groups, the ViT's width): --use-checkpoint-args takes the checkpoint's
    proc = _run([*script_flags(workspace, str(ckpt)), "--train-iters", "6", "--use-checkpoint-opt_param-scheduler",
                 "--num-query-groups", "4", "--vision-hidden-size", "64"], check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    note = next(line for line in proc.stdout.splitlines() if "--use-checkpoint-args took the model shape" in line)
    assert "--vision-hidden-size 32" in note and "--num-query-groups 2" in note, note
    assert [d["iteration"] for d in _train(proc.stdout)] == [5, 6], proc.stdout[-3000:]


def test_a_metadataset_naming_a_missing_dataset_is_one_line(workspace, tmp_path):
    bad = workspace["root"] / "missing_dataset.yaml"
    bad.write_text(METADATASET.format(train="data/nowhere", val="data/validation/dataset"))
    flags = [str(bad) if f == workspace["yaml"] else f
             for f in script_flags(workspace, str(tmp_path))]
    proc = _run(flags, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --data-path {bad}: the train split names the dataset {workspace['root'] / 'data/nowhere'}, "
        "which does not exist (paths are relative to the yaml's folder)")
