"""energon metadatasets (Megatron's ``examples/multimodal/pretrain_dataset.yaml``) as ``pretrain_vlm.py
--data-path``, and validation on an energon dataset's ``val`` split: the folders a split names (relative
to the yaml, v1 ``Metadataset`` and ``MetadatasetV2``), each checked for its sample type; one line naming
the file for a metadataset that does not parse or names a missing dataset; the val split read in its
stored order, unshuffled, again from its start after its end; validation from ``--valid-data-path`` /
``--valid-path``, else from ``--data-path``'s val split, else none (a note); ``--img-embedding-idx``
accepted with a note."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest
from PIL import Image

from tests.unit.test_llava_family import COLORS, vlm_args, write_llava_data

pytest.importorskip("megatron.energon")

from megatrain.data.multimodal import energon as mm_energon  # noqa: E402

V1 = """__module__: megatron.energon
__class__: Metadataset
splits:
  train:
    datasets:
      - weight: 1.
        path: {train}
        subflavors:
          augmentation: false
{val}"""
V1_VAL = """  val:
    datasets:
      - weight: 1.
        path: {val}
"""
V2 = """__module__: megatron.energon
__class__: MetadatasetV2
splits:
  train:
    blend:
      - weight: 1
        path: {train}
  val:
    path: {val}
"""


def _vqa(root: Path, name: str, keys: list[str], ratio, sample_type: str = "VQASample") -> Path:
    from tests.unit.test_multimodal_data import write_shards

    rng = random.Random(len(keys))
    items = []
    for key in keys:
        rgb, answer = COLORS[rng.choice(sorted(COLORS))]
        items.append((key, Image.new("RGB", (20, 18), rgb), {"question": "what is this ?", "answers": [answer]}))
    folder = root / name
    folder.mkdir(parents=True)
    fields = ({"image": "jpg", "context": "json[question]", "answers": "json[answers]"} if sample_type == "VQASample"
              else {"image": "jpg", "caption": "json[question]"})
    mm_energon.prepare_dataset(str(folder), write_shards(folder, items, per_shard=3), sample_type, fields,
                               split_ratio=ratio)
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("mds")
    paths = write_llava_data(root / "tok", n=1)
    train = _vqa(root / "sets", "train", [f"t{k:03d}" for k in range(9)], (1, 0, 0))
    val = _vqa(root / "sets", "val", [f"v{k:03d}" for k in range(5)], (0, 1, 0))
    both = _vqa(root / "sets", "both", [f"b{k:03d}" for k in range(10)], (0.6, 0.4, 0))
    (root / "pretrain_dataset.yaml").write_text(V1.format(train="sets/train", val=V1_VAL.format(val="sets/val")))
    (root / "v2.yaml").write_text(V2.format(train="sets/train", val="sets/val"))
    (root / "train_only.yaml").write_text(V1.format(train="sets/train", val=""))
    return {"root": root, "tok": paths["tok"], "train": train, "val": val, "both": both,
            "yaml": root / "pretrain_dataset.yaml", "paths": paths}


@pytest.mark.parametrize("name", ["pretrain_dataset.yaml", "v2.yaml"])
def test_a_split_names_its_folders_relative_to_the_yaml(data, name):
    yaml = str(data["root"] / name)
    assert mm_energon.is_metadataset(yaml)
    assert mm_energon.check_energon_path(yaml, "--data-path x", "train") == [str(data["train"])]
    assert mm_energon.check_energon_path(yaml, "--data-path x", "val") == [str(data["val"])]
    assert mm_energon.check_energon_path(yaml, "--data-path x", "test") is None
    assert mm_energon.split_length(yaml, "train", "w") == 9
    assert mm_energon.split_length(yaml, "val", "w") == 5
    assert mm_energon.split_length(str(data["train"]), "val", "w") == 0  # a folder without a val part


@pytest.mark.parametrize("text,message", [
    ("splits: [1", "not a valid YAML file (while parsing a flow sequence, line 1)"),
    ("x: 1\n", "not an energon metadataset (expected __module__: megatron.energon, __class__: Metadataset or "
               "MetadatasetV2, and splits: {{train: {{datasets: [...]}}, val: ...}})"),
    (V1.format(train="sets/nowhere", val=""), "the train split names the dataset {root}/sets/nowhere, which does "
                                              "not exist (paths are relative to the yaml's folder)"),
    (V1.format(train="sets/train", val="").replace("weight:", "wieght:"),
     "cannot read the energon metadataset's train split (JsonValueError: Additional attributes for DatasetReference"),
    (V1.format(train="tok", val=""), "the train split names {root}/tok, which is not a prepared energon dataset "
                                     "(no .nv-meta/.info.json: run `energon prepare` on it)"),
], ids=["yaml", "not_mds", "missing", "bad_field", "not_prepared"])
def test_a_bad_metadataset_is_one_line_naming_the_file(data, tmp_path, text, message):
    bad = data["root"] / f"bad_{tmp_path.name}.yaml"
    bad.write_text(text)
    with pytest.raises(ValueError) as err:
        mm_energon.check_energon_path(str(bad), f"--data-path {bad}", "train")
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"--data-path {bad}: " + message.format(root=data["root"])), line


def test_a_yml_file_and_a_missing_file_are_one_line(data, tmp_path):
    yml = tmp_path / "d.yml"
    yml.write_text(data["yaml"].read_text())
    with pytest.raises(ValueError, match=r"d\.yml: energon reads a metadataset only from a file named \*\.yaml"):
        mm_energon.check_energon_path(str(yml), f"--data-path {yml}")
    with pytest.raises(ValueError, match="nope.yaml: no such file"):
        mm_energon.check_energon_path(str(tmp_path / "nope.yaml"), f"--data-path {tmp_path / 'nope.yaml'}")


def test_a_sample_type_megatrain_does_not_read_is_named_per_dataset(data, tmp_path):
    other = _vqa(tmp_path, "ocr", ["o000", "o001"], (1, 0, 0), sample_type="OCRSample")
    yaml = tmp_path / "m.yaml"
    yaml.write_text(V1.format(train=str(other), val=""))
    with pytest.raises(ValueError) as err:
        mm_energon.check_energon_path(str(yaml), f"--data-path {yaml}")
    assert str(err.value).startswith(f"--data-path {yaml} (its train dataset {other}): energon sample type "
                                     "OCRSample is not read by megatrain"), str(err.value)


def _encoder(data):
    from megatrain.data.multimodal import CLIPImageProcessor, ConversationEncoder
    from megatrain.data.tokenizers import TokenizerConfig, build_tokenizer

    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=data["tok"]))
    return ConversationEncoder(tok, 32), CLIPImageProcessor.from_pretrained(None, size=16)


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")
def test_the_val_split_is_read_in_order_and_again_from_its_start(data):
    from megatrain.data.multimodal.energon_samples import EnergonSamples

    encoder, processor = _encoder(data)
    val = EnergonSamples(str(data["yaml"]), encoder, processor, num_samples=12, split="val", flag="--valid-path")
    ids = [val[i]["id"] for i in range(12)]
    # the split's samples once each (in its shards' stored order), then again from the start
    assert sorted(ids[:5]) == [f"v{k:03d}" for k in range(5)] and ids[5:] == ids[:5] + ids[:2], ids
    again = EnergonSamples(str(data["yaml"]), encoder, processor, num_samples=12, split="val", seed=99)
    assert [again[i]["id"] for i in (7, 3, 11)] == [ids[7], ids[3], ids[11]]  # no seed, no shuffling
    train = EnergonSamples(str(data["yaml"]), encoder, processor, num_samples=9, split="train")
    assert all(train[i]["id"].startswith("t") for i in range(9))  # energon's shuffled train stream
    folder_val = EnergonSamples(str(data["both"]), encoder, processor, num_samples=4, split="val")
    assert all(folder_val[i]["id"].startswith("b") for i in range(4))


def test_validation_comes_from_the_val_split(data, capsys):
    def build(train, *extra):
        from megatrain.models.llava.datasets import build_llava_datasets
        from megatrain.training.main import parse_family_args

        flags = [str(train) if f == data["paths"]["data"] else f for f in vlm_args(data["paths"])]
        args = parse_family_args("llava", [*flags, *extra, "--train-iters", "2"], prog="pretrain_vlm.py")
        encoder, _ = _encoder(data)
        return args, build_llava_datasets(args, encoder.tokenizer, [4, 6, 2])

    yaml = str(data["yaml"])
    _, (train, valid, test) = build(yaml)  # no --valid-data-path: --data-path's val split, as Megatron
    assert (train.path, train.split, valid.path, valid.split, test) == (yaml, "train", yaml, "val", None)
    assert f"note: validation reads the val split of --data-path {yaml} (5 samples, in order, unshuffled)" in \
        capsys.readouterr().out
    _, (_, valid, _) = build(yaml, "--valid-path", str(data["both"]))  # Megatron's older flag
    assert (valid.path, valid.split, valid.flag) == (str(data["both"]), "val", "--valid-path")
    _, (_, valid, _) = build(str(data["root"] / "train_only.yaml"))
    assert valid is None
    assert f"note: no validation: --data-path {data['root'] / 'train_only.yaml'} has no val split samples" in \
        capsys.readouterr().out
    with pytest.raises(ValueError, match=f"--valid-data-path {data['train']}: the energon dataset's val split has "
                                         "no samples"):
        build(yaml, "--valid-data-path", str(data["train"]))
    # a LLaVA jsonl: as before, validation only from --valid-data-path
    _, (_, valid, _) = build(data["paths"]["data"])
    assert valid is None


def test_valid_path_is_valid_data_path_and_img_embedding_idx_is_noted(data):
    from megatrain.training.main import parse_family_args

    base = [*vlm_args(data["paths"]), "--train-iters", "2"]
    args = parse_family_args("llava", [*base, "--valid-path", "a.jsonl", "--img-embedding-idx", "1"],
                             prog="pretrain_vlm.py")
    assert args.valid_data_path == ["a.jsonl"]
    assert any("--img-embedding-idx 1: ignored" in n for n in args.legacy_notes), args.legacy_notes
    same = parse_family_args("llava", [*base, "--valid-path", "a.jsonl", "--valid-data-path", "a.jsonl"],
                             prog="pretrain_vlm.py")
    assert same.valid_data_path == ["a.jsonl"]
    with pytest.raises(SystemExit) as err:
        parse_family_args("llava", [*base, "--valid-path", "a.jsonl", "--valid-data-path", "b.jsonl"],
                          prog="pretrain_vlm.py")
    assert str(err.value) == ("error: --valid-path a.jsonl and --valid-data-path b.jsonl: give one (--valid-path is "
                              "Megatron's older name of --valid-data-path)")
    assert isinstance(args, argparse.Namespace)
