"""megatron-energon datasets with several images per sample: ``SimilarityInterleavedSample`` shards
(Megatron's LLaVA SFT layout, written here as tar shards + ``.nv-meta`` by ``prepare_dataset`` with
``LLAVA_SAMPLE_LOADER``) read into exactly the samples the LLaVA jsonl dataset makes of the same
lines and image files; Megatron's placement of images in the text (``<image-N>`` tags, missing
placeholders first, one image repeated); ``MultiChoiceVQASample`` and a ``VQASample`` with a list of
images; and a sample type megatrain does not read refused in one line naming it and the folder.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from megatrain.data.multimodal import ConversationEncoder, LlavaJsonlDataset, MultimodalBatch, MultimodalDataError
from tests.unit.test_multimodal_data import SMALL, noise_image, tokenizers  # noqa: F401 (a fixture)

energon = pytest.importorskip("megatron.energon")
from megatrain.data.multimodal import energon as mm_energon  # noqa: E402
from megatrain.data.multimodal.energon_samples import EnergonSamples  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")  # energon's loader, on CPU

TWO = [{"from": "human", "value": "<image>\nwhat is this ?"}, {"from": "gpt", "value": "a cat ."},
       {"from": "human", "value": "<image>\ndescribe"}, {"from": "gpt", "value": "a dog ."}]


def _bytes(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _lines(images: Path) -> list[tuple[dict, list[tuple[str, bytes]]]]:
    """LLaVA lines and their image files: two images (JPEG and a transparent PNG), two images in one
    turn, one image, text only."""
    a = _bytes(noise_image("RGB", 41, 29, seed=1), "JPEG")
    b = _bytes(noise_image("RGBA", 23, 57, seed=2), "PNG")
    c = _bytes(noise_image("L", 30, 30, seed=3), "PNG")
    d = _bytes(noise_image("RGB", 50, 35, seed=4), "JPEG")
    lines = [({"id": "two", "conversations": TWO}, [("jpg", a), ("png", b)]),
             ({"id": "pair", "conversations": [{"from": "human", "value": "<image> <image>\nwhat is this ?"},
                                               {"from": "gpt", "value": "a red bus ."}]}, [("png", c), ("jpg", d)]),
             ({"id": "one", "conversations": [{"from": "human", "value": "<image>\ndescribe"},
                                              {"from": "gpt", "value": "a cat ."}]}, [("jpg", d)]),
             ({"id": "text", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]},
              [])]
    images.mkdir(parents=True, exist_ok=True)
    for line, files in lines:
        paths = []
        for i, (ext, data) in enumerate(files):
            (images / f"{line['id']}_{i}.{ext}").write_bytes(data)
            paths.append(f"{line['id']}_{i}.{ext}")
        if paths:
            line["image"] = paths
    return lines


def _write_interleaved_shards(root: Path, lines: list, per_shard: int = 2) -> list[str]:
    """Each line as ``KEY.json`` (the line) and ``KEY.0.EXT``, ``KEY.1.EXT``, ... (one image: ``KEY.EXT``)."""
    root.mkdir(parents=True, exist_ok=True)
    shards = []
    for s in range(0, len(lines), per_shard):
        name = f"part_{s // per_shard:03d}.tar"
        with tarfile.open(root / name, "w") as tar:
            for line, files in lines[s:s + per_shard]:
                members = [("json", json.dumps(line).encode())]
                members += [(ext if len(files) == 1 else f"{i}.{ext}", data) for i, (ext, data) in enumerate(files)]
                for ext, data in members:
                    info = tarfile.TarInfo(f"{line['id']}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        shards.append(name)
    return shards


@pytest.fixture()
def encoder(tokenizers):  # noqa: F811
    return ConversationEncoder(tokenizers["native"], seq_length=48)


def _key(sample_id: str) -> str:
    return sample_id.rsplit("/", 1)[-1]


def test_two_image_samples_equal_the_jsonl_samples(tmp_path, encoder):
    lines = _lines(tmp_path / "images")
    root = tmp_path / "wds"
    shards = _write_interleaved_shards(root, lines)
    mm_energon.prepare_dataset(str(root), shards, "SimilarityInterleavedSample",
                               sample_loader=mm_energon.LLAVA_SAMPLE_LOADER)
    meta = root / ".nv-meta"
    assert (meta / "sample_loader.py").read_text() == mm_energon.LLAVA_SAMPLE_LOADER
    assert {"split.yaml", "dataset.yaml", ".info.json", "index.sqlite"} <= {p.name for p in meta.iterdir()}
    assert mm_energon.dataset_sample_type(str(root)) == ("SimilarityInterleavedSample",
                                                         energon.SimilarityInterleavedSample)

    jsonl = tmp_path / "same.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line, _ in lines))
    ds = LlavaJsonlDataset(str(jsonl), str(tmp_path / "images"), encoder, SMALL)
    expected = {s["id"]: s for s in (ds.sample_of_line(j) for j in range(ds.num_lines))}
    assert [expected[k]["num_images"] for k in ("two", "pair", "one", "text")] == [2, 2, 1, 0]

    # megatrain's loader's view: EnergonSamples, sample i of energon's seeded stream
    samples = EnergonSamples(str(root), encoder, SMALL, num_samples=len(lines), shuffle_buffer_size=None)
    seen = {}
    for i in range(len(lines)):  # one epoch of a 4-sample dataset: each sample once
        s = samples[i]
        seen[_key(s["id"])] = s
    assert set(seen) == set(expected)
    for key, s in seen.items():
        e = expected[key]
        assert np.asarray(s["tokens"]).tolist() == e["tokens"].tolist(), key
        assert np.asarray(s["targets"]).tolist() == e["targets"].tolist(), key
        assert s["num_images"] == e["num_images"], key
        assert s["pixel_values"].shape == e["pixel_values"].shape, key
        assert torch.equal(s["pixel_values"], e["pixel_values"]), key  # the transparent PNG too
    # the images in the order of their placeholders: the files' order
    two = [SMALL(Image.open(tmp_path / "images" / p)) for p in ("two_0.jpg", "two_1.png")]
    assert torch.equal(seen["two"]["pixel_values"], torch.stack(two))

    # batched by energon into megatrain's batch: images concatenated in sample order, counted per row
    task_encoder = mm_energon.LlavaTaskEncoder(encoder, SMALL)
    batched = mm_energon.get_train_dataset(str(root), task_encoder, batch_size=4, shuffle_buffer_size=None,
                                           max_samples_per_sequence=None)
    batch = next(iter(energon.get_savable_loader(batched, gc_collect_every_n_steps=0)))
    assert isinstance(batch, MultimodalBatch)
    order = [_key(k) for k in batch_keys(batch, seen)]
    assert batch.image_counts.tolist() == [expected[k]["num_images"] for k in order]
    assert torch.equal(batch.pixel_values, torch.cat([expected[k]["pixel_values"] for k in order]))


def batch_keys(batch: MultimodalBatch, seen: dict) -> list[str]:
    """The batch's rows' sample keys, found by their tokens (a MultimodalBatch keeps no ids)."""
    keys = []
    for r in range(batch.tokens.shape[0]):
        n = int(batch.lengths[r]) + 1
        row = batch.tokens[r, :n - 1].tolist()
        keys += [k for k, s in seen.items() if np.asarray(s["tokens"]).tolist()[:-1] == row]
    return keys


def _interleaved(images: list, texts: list, key: str = "k") -> object:
    return energon.SimilarityInterleavedSample(__key__=key, __restore_key__=(), __subflavors__={}, images=images,
                                               texts=texts)


def test_megatrons_placement_of_several_images(tmp_path):
    x, y, z = "X", "Y", "Z"  # stand-ins for images: the order is what is checked
    turns = lambda first: [{"from": "human", "value": first}, {"from": "gpt", "value": "a cat ."}]  # noqa: E731
    # <image-N> tags: image N (1-based), in the tags' order
    conv, images = mm_energon.to_conversation(_interleaved([x, y, z], turns("<image-3> then <image-1> ?")), "")
    assert conv[0]["value"] == "<image> then <image> ?" and images == [z, x]
    # fewer placeholders than images: the missing ones first in the first human turn
    conv, images = mm_energon.to_conversation(_interleaved([x, y], turns("what is this ?")), "")
    assert conv[0]["value"] == "<image><image>\nwhat is this ?" and images == [x, y]
    conv, images = mm_energon.to_conversation(_interleaved([x, y, z], turns("<image>\nwhat ?")), "")
    assert conv[0]["value"] == "<image><image>\n<image>\nwhat ?" and images == [x, y, z]
    # one image, several placeholders: the image at each
    conv, images = mm_energon.to_conversation(_interleaved([x], turns("<image> and <image>")), "")
    assert images == [x, x]
    # no images: the placeholders go (text only)
    conv, images = mm_energon.to_conversation(_interleaved([], turns("<image>\nhello")), "")
    assert conv[0]["value"] == "\nhello" and images == []
    # the input is not changed
    texts = turns("<image-1>")
    mm_energon.to_conversation(_interleaved([x], texts), "")
    assert texts[0]["value"] == "<image-1>"
    with pytest.raises(MultimodalDataError, match=r"^energon sample k: has 3 <image> placeholders but 2 images$"):
        mm_energon.to_conversation(_interleaved([x, y], turns("<image><image><image>")), "")
    with pytest.raises(MultimodalDataError, match=r"<image-4> names image 4 but the sample has 2 images$"):
        mm_energon.to_conversation(_interleaved([x, y], turns("<image-4>")), "")
    with pytest.raises(MultimodalDataError, match=r"texts must be LLaVA turns"):
        mm_energon.to_conversation(_interleaved([x], ["a document", "its second sentence"]), "")


def test_multichoice_and_a_vqa_sample_with_a_list_of_images(encoder):
    mc = energon.MultiChoiceVQASample(__key__="m", __restore_key__=(), __subflavors__={}, image="X",
                                      context="what is this ?", choices=["a cat", "a dog"], correct_choice_idx=1)
    conv, images = mm_energon.to_conversation(mc, "")
    assert conv == [{"from": "human", "value": "<image>\nwhat is this ?\nA. a cat\nB. a dog\nAnswer with the "
                                               "option's letter from the given choices directly."},
                    {"from": "gpt", "value": "B"}] and images == ["X"]
    bad = energon.MultiChoiceVQASample(__key__="m", __restore_key__=(), __subflavors__={}, image="X", context="?",
                                       choices=["a"], correct_choice_idx=3)
    with pytest.raises(MultimodalDataError, match="correct_choice_idx 3 is not one of its 1 choices"):
        mm_energon.to_conversation(bad, "")
    # a VQASample whose image is a list (a sample_loader's): each image, the placeholders first
    vqa = energon.VQASample(__key__="v", __restore_key__=(), __subflavors__={}, image=["X", "Y"],
                            context="what is this ?", answers="a cat .")
    conv, images = mm_energon.to_conversation(vqa, "")
    assert conv[0]["value"] == "<image><image>\nwhat is this ?" and conv[1]["value"] == "a cat ."
    assert images == ["X", "Y"]
    # encoded as the jsonl path encodes the same turns with two images
    a, b = noise_image("RGB", 40, 30, seed=5), noise_image("L", 30, 40, seed=6)
    vqa = energon.VQASample(__key__="v", __restore_key__=(), __subflavors__={}, image=[a, b], context="describe",
                            answers=["a dog .", "hi"], answer_weights=torch.tensor([0.2, 0.1]))
    sample = mm_energon.LlavaTaskEncoder(encoder, SMALL).encode_sample(vqa)
    want = encoder.encode([{"from": "human", "value": "<image><image>\ndescribe"}, {"from": "gpt", "value": "a dog ."}],
                          2, "")
    assert sample["tokens"].tolist() == want.tokens.tolist() and sample["num_images"] == 2
    assert torch.equal(sample["pixel_values"], torch.stack([SMALL(a), SMALL(b)]))


def test_a_sample_type_megatrain_does_not_read_is_one_line(tmp_path, encoder):
    root = tmp_path / "interleaved"
    root.mkdir()
    with tarfile.open(root / "p.tar", "w") as tar:
        for ext, data in (("txt", b"a cat ."), ("jpg", _bytes(noise_image("RGB", 20, 20), "JPEG"))):
            info = tarfile.TarInfo(f"s0.{ext}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    loader = ("def sample_loader(raw):\n    return dict(sequence=[raw['jpg'], raw['txt']])\n\n"
              "def part_filter(part):\n    return part in ('jpg', 'txt')\n")
    mm_energon.prepare_dataset(str(root), ["p.tar"], "InterleavedSample", sample_loader=loader)
    line = (rf"^--data-path {re.escape(str(root))}: energon sample type InterleavedSample is not read by megatrain "
            r"\(it reads SimilarityInterleavedSample, VQASample, MultiChoiceVQASample, CaptioningSample\); ")
    with pytest.raises(MultimodalDataError, match=line) as info:
        EnergonSamples(str(root), encoder, SMALL, num_samples=1)
    assert "\n" not in str(info.value)
    with pytest.raises(MultimodalDataError, match=rf"^{re.escape(str(root))}: energon sample type InterleavedSample"):
        mm_energon.get_train_dataset(str(root), mm_energon.LlavaTaskEncoder(encoder, SMALL))
    # a sample of such a type that reaches the encoder (no dataset.yaml to tell): named with its source
    sample = energon.InterleavedSample(__key__="s0", __restore_key__=(), __subflavors__={}, sequence=["a cat ."])
    with pytest.raises(MultimodalDataError, match=r"^energon sample s0: energon sample type InterleavedSample is not "
                                                  r"read by megatrain"):
        mm_energon.LlavaTaskEncoder(encoder, SMALL).encode_sample(sample)
    # a bad sample of a real dataset: named by its dataset folder, shard and key
    bad = tmp_path / "bad"
    conv = [{"from": "human", "value": "<image><image><image>"}, {"from": "gpt", "value": "hi"}]
    jpg = _bytes(noise_image("RGB", 20, 20), "JPEG")
    shards = _write_interleaved_shards(bad, [({"id": "b0", "conversations": conv}, [("jpg", jpg), ("jpg", jpg)])])
    mm_energon.prepare_dataset(str(bad), shards, "SimilarityInterleavedSample",
                               sample_loader=mm_energon.LLAVA_SAMPLE_LOADER)
    with pytest.raises(MultimodalDataError, match=rf"^energon {re.escape(str(bad))}/part_000.tar: sample b0: has 3 "
                                                  r"<image> placeholders but 2 images$"):
        EnergonSamples(str(bad), encoder, SMALL, num_samples=1)[0]
    # a webdataset class of the older dataset.yaml layout is its sample type
    (root / ".nv-meta" / "dataset.yaml").write_text("__module__: megatron.energon\n__class__: OCRWebdataset\n")
    assert mm_energon.dataset_sample_type(str(root)) == ("OCRSample", energon.OCRSample)
    with pytest.raises(MultimodalDataError, match=r"energon sample type OCRSample is not read by megatrain"):
        mm_energon.check_sample_type(str(root), "here")
