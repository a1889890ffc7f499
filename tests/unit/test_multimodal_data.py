"""Multimodal (LLaVA-style) data: CLIP preprocessing equal to transformers' PIL processor, LLaVA jsonl
conversations with ``<image>`` placeholders and answer-only targets, a seeded resumable order, bad
images and lines named with file and line (or skipped and counted), batches mixing text-only and
image samples, and megatron-energon shards read into the same samples.

Images are generated here with PIL; the tokenizer is a word-level ``tokenizer.json`` built offline
with the ``tokenizers`` library.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from megatrain.data.loader import PretrainingSampler
from megatrain.data.multimodal import (CLIPImageConfig, CLIPImageProcessor, ConversationEncoder, LlavaJsonlDataset,
                                       MultimodalBatch, MultimodalCollator, MultimodalDataError)
from megatrain.data.tokenizers import TokenizerConfig, build_tokenizer

# --------------------------------------------------------------------------------------------- images


def noise_image(mode: str, width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.RandomState(seed)
    bands = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4}[mode]
    pixels = rng.randint(0, 256, size=(height, width, bands), dtype=np.uint8)
    # smooth ramps on top of the noise, so that resampling has something to interpolate
    ramp = (np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, bands))).astype(np.uint8)
    pixels = (pixels // 2 + ramp // 2).astype(np.uint8)
    return Image.fromarray(pixels[..., 0] if bands == 1 else pixels, mode=mode)


def palette_with_transparency() -> Image.Image:
    image = noise_image("RGB", 61, 45, seed=5).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    image.info["transparency"] = 3
    return image


TEST_IMAGES = {
    "rgb_odd": lambda: noise_image("RGB", 37, 53, seed=1),
    "rgba_tall": lambda: noise_image("RGBA", 40, 311, seed=2),
    "l_wide": lambda: noise_image("L", 517, 61, seed=3),
    "la_square": lambda: noise_image("LA", 224, 224, seed=4),
    "p_transparent": palette_with_transparency,
    "rgb_big": lambda: noise_image("RGB", 641, 479, seed=6),
}


@pytest.fixture(scope="module")
def hf_clip():
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, "CLIPImageProcessorPil", None)
    if cls is None:  # transformers 4: the slow processor is CLIPImageProcessor itself
        return lambda **kw: transformers.CLIPImageProcessor(**kw)
    return cls


@pytest.mark.parametrize("size,crop", [(224, 224), (336, 336), (200, 224)])
def test_clip_preprocessing_equals_transformers(hf_clip, size, crop):
    hf = hf_clip(size={"shortest_edge": size}, crop_size={"height": crop, "width": crop})
    ours = CLIPImageProcessor(CLIPImageConfig(shortest_edge=size, crop_size=(crop, crop)))
    for name, make in TEST_IMAGES.items():
        expected = torch.from_numpy(np.asarray(hf(make(), return_tensors="np")["pixel_values"][0]))
        got = ours(make())
        assert got.shape == (3, crop, crop) and got.dtype == torch.float32, name
        # the same operations on the same float types: equal to the bit, not only within 1e-5
        assert torch.equal(got, expected), (name, (got - expected).abs().max())


def test_clip_config_from_a_model_folder(tmp_path, hf_clip):
    folder = tmp_path / "clip-336"
    folder.mkdir()
    # the file as openai/clip-vit-large-patch14-336 has it (older transformers' int sizes)
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "crop_size": 336, "do_center_crop": True, "do_normalize": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "size": 336}))
    ours = CLIPImageProcessor.from_pretrained(str(folder))
    assert ours.config == CLIPImageConfig.default(336)
    assert ours.output_shape == (3, 336, 336)
    hf = hf_clip(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    image = TEST_IMAGES["rgba_tall"]()
    assert torch.equal(ours(image), torch.from_numpy(hf(image, return_tensors="np")["pixel_values"][0]))
    # a processor saved by transformers reads back the same
    hf.save_pretrained(str(tmp_path / "saved"))
    assert CLIPImageProcessor.from_pretrained(str(tmp_path / "saved")).config == CLIPImageConfig.default(336)
    assert CLIPImageProcessor.from_pretrained(None, size=224).config == CLIPImageConfig.default(224)
    (folder / "preprocessor_config.json").write_text('{"size": {"longest_edge": 5}}')
    with pytest.raises(ValueError, match=r"preprocessor_config.json: size .* is not supported"):
        CLIPImageConfig.from_pretrained(str(folder))


# ------------------------------------------------------------------------------------------ tokenizer

WORDS = ["<unk>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "\n", " ", "what", "is", "this", "?", "a",
         "cat", "dog", "red", "bus", ".", "describe", "hello", "hi", "long"]
UNK, EOS, SYS, USR, AST, NL, SP, WHAT, IS, THIS, Q, A, CAT, DOG, RED, BUS, DOT, DESCRIBE, HELLO, HI, LONG = \
    range(len(WORDS))
IMG = len(WORDS)  # <image> in the tokenizer that has it; the id given to the one that does not


def write_tokenizer(folder: Path, with_image_token: bool, chat_template: str | None = None) -> str:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    words = WORDS + (["<image>"] if with_image_token else [])
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s"), behavior="isolated"),
                                                 pre_tokenizers.Punctuation(behavior="isolated")])
    tok.add_special_tokens(WORDS[:5] + (["<image>"] if with_image_token else []))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}
                                                             if chat_template else config))
    return str(folder)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("mm_tok")
    native = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                             tokenizer_model=write_tokenizer(root / "native", True)))
    split = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                            tokenizer_model=write_tokenizer(root / "split", False)))
    return {"native": native, "split": split, "root": root}


CONV = [{"from": "human", "value": "<image>\nwhat is this ?"}, {"from": "gpt", "value": "a red bus ."}]
# megatrain's template: <|user|>\n{content}\n<|assistant|>\n{content}\n EOD; loss on the answer and EOD
CONV_TOKENS = [USR, NL, IMG, NL, WHAT, SP, IS, SP, THIS, SP, Q, NL, AST, NL, A, SP, RED, SP, BUS, SP, DOT, NL, EOS]
CONV_TARGETS = [0] * 14 + [1] * 9


@pytest.mark.parametrize("mode", ["native", "split"])
def test_conversation_tokens_and_answer_only_targets(tokenizers, mode):
    enc = ConversationEncoder(tokenizers[mode], seq_length=64, image_token_id=None if mode == "native" else IMG)
    assert enc.mode == mode and enc.image_token_id == IMG
    out = enc.encode(CONV, 1, "x.jsonl:1")
    assert out.tokens.tolist() == CONV_TOKENS
    assert out.targets.tolist() == CONV_TARGETS
    assert not out.truncated
    # pre-expanded: 4 image ids, none a target
    out4 = ConversationEncoder(tokenizers[mode], 64, IMG, num_image_tokens=4).encode(CONV, 1, "x.jsonl:1")
    assert out4.tokens.tolist() == CONV_TOKENS[:2] + [IMG] * 4 + CONV_TOKENS[3:]
    assert out4.targets.tolist() == [0] * 17 + [1] * 9
    # text only, and a system turn
    text = [{"from": "system", "value": "hi"}, {"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]
    out = enc.encode(text, 0, "x.jsonl:2")
    assert out.tokens.tolist() == [SYS, NL, HI, NL, USR, NL, HELLO, NL, AST, NL, HI, NL, EOS]
    assert out.targets.tolist() == [0] * 10 + [1] * 3


def test_conversation_errors(tokenizers):
    enc = ConversationEncoder(tokenizers["split"], seq_length=64, image_token_id=IMG)
    with pytest.raises(MultimodalDataError, match=r"^d.jsonl:3: has an image but 0 <image> placeholders"):
        enc.encode([{"from": "human", "value": "what"}, {"from": "gpt", "value": "a"}], 1, "d.jsonl:3")
    with pytest.raises(MultimodalDataError, match=r"^d.jsonl:4: has no \"image\" but 1 <image>"):
        enc.encode(CONV, 0, "d.jsonl:4")
    with pytest.raises(MultimodalDataError, match=r"no \"gpt\" turn"):
        enc.encode([{"from": "human", "value": "what"}], 0, "d.jsonl:5")
    with pytest.raises(MultimodalDataError, match=r"turn 1 is from 'bot'"):
        enc.encode([{"from": "human", "value": "what"}, {"from": "bot", "value": "a"}], 0, "d.jsonl:6")
    with pytest.raises(ValueError, match="give image_token_id"):
        ConversationEncoder(tokenizers["split"], seq_length=64)
    # the image's tokens must fit; text after it is cut
    with pytest.raises(MultimodalDataError, match=r"image's tokens end at token 10 but .* seq_length \+ 1 = 9"):
        ConversationEncoder(tokenizers["split"], 8, IMG, num_image_tokens=8).encode(CONV, 1, "d.jsonl:7")
    cut = ConversationEncoder(tokenizers["split"], 9, IMG).encode(CONV, 1, "d.jsonl:8")
    assert cut.truncated and cut.tokens.tolist() == CONV_TOKENS[:10]


def test_chat_template_renders_the_conversation(tokenizers):
    template = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    root = tokenizers["root"]
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                          tokenizer_model=write_tokenizer(root / "tmpl", True, template)))
    out = ConversationEncoder(tok, seq_length=64).encode(CONV, 1, "x.jsonl:1")
    assert out.tokens.tolist() == CONV_TOKENS[:-1]  # the template's text: no EOD appended
    # the loss covers the assistant's turn as the template writes it (megatrain's chat_with_targets)
    assert out.targets[:12].tolist() == [0] * 12 and out.targets[14:21].tolist() == [1] * 7
    split = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                            tokenizer_model=write_tokenizer(root / "tmpl_split", False, template)))
    with pytest.raises(ValueError, match=r"with its chat template, so <image> must be one token"):
        ConversationEncoder(split, seq_length=64, image_token_id=IMG)


def test_sft_tokenizer_prompt_format_needs_the_image_token(tokenizers):
    root = tokenizers["root"]
    sft = build_tokenizer(TokenizerConfig(tokenizer_type="SFTTokenizer", tokenizer_model=str(root / "native"),
                                          sft_tokenizer_prompt_format="identity"))
    out = ConversationEncoder(sft, seq_length=64).encode(CONV, 1, "x.jsonl:1")
    # identity: the contents one after another; the targets on the assistant's tokens
    assert out.tokens.tolist() == [IMG, NL, WHAT, SP, IS, SP, THIS, SP, Q, A, SP, RED, SP, BUS, SP, DOT]
    assert out.targets.tolist() == [0] * 9 + [1] * 7
    sft_split = build_tokenizer(TokenizerConfig(tokenizer_type="SFTTokenizer", tokenizer_model=str(root / "split"),
                                                sft_tokenizer_prompt_format="identity"))
    with pytest.raises(ValueError, match=r"<image> must be one token of its vocabulary"):
        ConversationEncoder(sft_split, seq_length=64, image_token_id=IMG)


# -------------------------------------------------------------------------------------------- dataset

QUESTIONS = [("what is this ?", "a cat ."), ("describe", "a red bus ."), ("what is this ?", "a dog ."),
             ("describe", "a cat .")]


def write_llava(tmp_path: Path, rows: list, name: str = "d.jsonl") -> tuple[str, str]:
    images = tmp_path / "images"
    (images / "sub").mkdir(parents=True, exist_ok=True)
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path), str(images)


def save_image(images: str, rel: str, image: Image.Image) -> str:
    image.save(str(Path(images) / rel))
    return rel


def llava_rows(images: str, n: int = 4) -> list:
    rows = []
    for k in range(n):
        q, a = QUESTIONS[k % len(QUESTIONS)]
        if k % 3 == 2:  # text only
            rows.append({"id": f"t{k}", "conversations": [{"from": "human", "value": q},
                                                          {"from": "gpt", "value": a}]})
            continue
        mode, ext = (("RGBA", "png") if k % 2 else ("RGB", "jpg"))
        rel = save_image(images, f"sub/{k}.{ext}", noise_image(mode, 50 + 13 * k, 70 - 5 * k, seed=k))
        rows.append({"id": f"i{k}", "image": rel,
                     "conversations": [{"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": a}]})
    return rows


# where the pixels' values do not matter: CLIP's preprocessing at 32 px, 49 times less work than 224
SMALL = CLIPImageProcessor(CLIPImageConfig.default(32))


@pytest.fixture()
def encoder(tokenizers):
    return ConversationEncoder(tokenizers["native"], seq_length=48)


def test_dataset_samples(tmp_path, encoder, tokenizers):
    path, images = write_llava(tmp_path, [])
    rows = llava_rows(images, 6)
    write_llava(tmp_path, rows)
    ds = LlavaJsonlDataset(path, images, encoder, seed=7)
    assert len(ds) == 6
    processor = CLIPImageProcessor()
    by_id = {s["id"]: s for s in (ds[i] for i in range(len(ds)))}
    assert set(by_id) == {r["id"] for r in rows}
    for row in rows:
        s = by_id[row["id"]]
        expected = encoder.encode(row["conversations"], int("image" in row), "")
        assert s["tokens"].tolist() == expected.tokens.tolist()
        assert s["targets"].tolist() == expected.targets.tolist()
        if "image" in row:
            assert s["num_images"] == 1
            assert torch.equal(s["pixel_values"][0], processor(Image.open(Path(images) / row["image"])))
        else:
            assert s["num_images"] == 0 and s["pixel_values"].shape == (0, 3, 224, 224)
    # loader workers get a pickled copy (split mode: the wrapped tokenizer travels too)
    split = ConversationEncoder(tokenizers["split"], seq_length=48, image_token_id=IMG)
    for dataset in (ds, LlavaJsonlDataset(path, images, split, seed=7)):
        copy = pickle.loads(pickle.dumps(dataset))
        assert copy[3]["tokens"].tolist() == dataset[3]["tokens"].tolist()
        assert torch.equal(copy[3]["pixel_values"], dataset[3]["pixel_values"])


def test_order_is_seeded_per_epoch_and_resumable(tmp_path, encoder):
    path, images = write_llava(tmp_path, [])
    write_llava(tmp_path, llava_rows(images, 5))
    ds = LlavaJsonlDataset(path, images, encoder, SMALL, seed=3, num_samples=15)
    again = LlavaJsonlDataset(path, images, encoder, SMALL, seed=3, num_samples=15)
    other = LlavaJsonlDataset(path, images, encoder, SMALL, seed=4, num_samples=15)
    ids = [ds[i]["id"] for i in range(15)]
    assert ids == [again[i]["id"] for i in range(15)]
    assert ids != [other[i]["id"] for i in range(15)]
    for epoch in range(3):  # every epoch is a permutation of the lines, each in its own order
        assert sorted(ids[5 * epoch:5 * epoch + 5]) == sorted(ids[:5])
    assert ids[:5] != ids[5:10] or ids[5:10] != ids[10:]
    # resuming with megatrain's sampler from a consumed-sample count continues the same batches
    collate = MultimodalCollator(pad_id=EOS, image_shape=(3, 32, 32))

    def batches(consumed: int) -> list[MultimodalBatch]:
        sampler = PretrainingSampler(len(ds), consumed, micro_batch_size=2, data_parallel_rank=0,
                                     data_parallel_size=1)
        return list(DataLoader(ds, batch_sampler=sampler, collate_fn=collate))

    full, resumed = batches(0), batches(6)
    assert len(resumed) == len(full) - 3
    for a, b in zip(full[3:], resumed):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.pixel_values, b.pixel_values)


def test_bad_images_name_the_line_or_are_skipped(tmp_path, encoder):
    path, images = write_llava(tmp_path, [])
    rows = llava_rows(images, 4)
    (Path(images) / "corrupt.jpg").write_bytes(b"not a jpeg at all")
    buf = io.BytesIO()
    noise_image("RGB", 300, 200, seed=9).save(buf, format="JPEG")
    (Path(images) / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    conv = [{"from": "human", "value": "<image>\ndescribe"}, {"from": "gpt", "value": "a cat ."}]
    rows[1:1] = [{"id": "missing", "image": "sub/nope.jpg", "conversations": conv},   # line 2
                 {"id": "corrupt", "image": "corrupt.jpg", "conversations": conv},    # line 3
                 {"id": "truncated", "image": "truncated.jpg", "conversations": conv}]  # line 4
    write_llava(tmp_path, rows)
    strict = LlavaJsonlDataset(path, images, encoder, SMALL, seed=0)
    j_of = {int(strict.linenos[j]): j for j in range(strict.num_lines)}
    for lineno, pattern in [(2, r"image .*sub/nope.jpg: no such file"),
                            (3, r"image .*corrupt.jpg: cannot read it \(UnidentifiedImageError"),
                            (4, r"image .*truncated.jpg: cannot read it \(OSError: image file is truncated")]:
        with pytest.raises(MultimodalDataError, match=rf"^--data-path {re.escape(path)}:{lineno}: {pattern}") as info:
            strict.sample_of_line(j_of[lineno])
        assert "\n" not in str(info.value) and info.value.kind == "image"
    with pytest.raises(MultimodalDataError, match=r"d.jsonl:[234]: image "):
        [strict[i] for i in range(len(strict))]

    # skipped at read time: the next line of the epoch's order stands in, the skip counted
    with pytest.warns(UserWarning, match="skipped: "):
        lenient = LlavaJsonlDataset(path, images, encoder, SMALL, seed=0, skip_bad_samples=True)
        samples = [lenient[i] for i in range(len(lenient))]
    assert sorted(lenient.bad_lines) == [2, 3, 4]
    assert sum(s["skipped"] for s in samples) >= 3
    assert not {"missing", "corrupt", "truncated"} & {s["id"] for s in samples}

    # checked when built: left out of the order (exact counts), or an error at once
    with pytest.warns(UserWarning, match=r"3 lines with an unreadable image are left out"):
        checked = LlavaJsonlDataset(path, images, encoder, SMALL, skip_bad_samples=True, check_images=True)
    assert checked.num_lines == 4 and sorted(checked.bad_lines) == [2, 3, 4]
    assert all(checked[i]["skipped"] == 0 for i in range(len(checked)))
    with pytest.raises(MultimodalDataError, match=r"d.jsonl:2: image .*nope.jpg: no such file"):
        LlavaJsonlDataset(path, images, encoder, SMALL, check_images=True)


@pytest.mark.parametrize("line,pattern", [
    ('{"id": 1, "conversations": [', r":2: not valid JSON"),
    ('{"id": 1, "image": "a.jpg"}', r":2: no \"conversations\" list \(the keys are 'id', 'image'\)"),
    ('[1, 2]', r":2: expected a JSON object with \"conversations\", got list"),
    ('{"conversations": []}', r":2: \"conversations\" must be a non-empty list"),
    # several images: as many <image> as paths, in the human turns; no empty list, only string paths
    ('{"image": ["a.jpg", "b.jpg"], "conversations": [{"from": "human", "value": "<image>"}, '
     '{"from": "gpt", "value": "a"}]}', r":2: has 2 images but 1 <image> placeholders in its turns; put one"),
    ('{"image": ["a.jpg"], "conversations": [{"from": "human", "value": "<image> <image>"}, '
     '{"from": "gpt", "value": "a"}]}', r":2: has an image but 2 <image> placeholders in its turns"),
    ('{"image": [], "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "a"}]}',
     r":2: \"image\" is an empty list: give one or more paths .* or leave \"image\" out \(or null\)"),
    ('{"image": ["a.jpg", 3], "conversations": [{"from": "human", "value": "<image><image>"}, '
     '{"from": "gpt", "value": "a"}]}', r":2: \"image\" entry 1 must be a path relative to the image folder, got 3$"),
    ('{"image": ["a.jpg", ""], "conversations": [{"from": "human", "value": "<image><image>"}, '
     '{"from": "gpt", "value": "a"}]}', r":2: \"image\" entry 1 must be a path .* got ''$"),
    ('{"image": {"a": 1}, "conversations": [{"from": "human", "value": "<image>"}, '
     '{"from": "gpt", "value": "a"}]}', r":2: \"image\" must be a path .* \(or a list of them\), got \{'a': 1\}"),
    ('{"image": ["a.jpg", "b.jpg"], "conversations": [{"from": "human", "value": "<image>"}, '
     '{"from": "gpt", "value": "<image> a"}]}', r":2: a \"gpt\" turn holds <image>"),
    ('{"conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "a"}]}',
     r":2: has no \"image\" but 1 <image> placeholder"),
])
def test_bad_lines_name_file_and_line(tmp_path, encoder, line, pattern):
    good = {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]}
    path, images = write_llava(tmp_path, [good, line, good])
    with pytest.raises(ValueError, match=rf"^--data-path {re.escape(path)}{pattern}") as info:
        LlavaJsonlDataset(path, images, encoder, SMALL, skip_bad_samples=True)
    assert "\n" not in str(info.value)


# -------------------------------------------------------------------------------------------- collate


def test_collate_mixes_text_only_and_image_samples(tmp_path, encoder):
    path, images = write_llava(tmp_path, [])
    rows = llava_rows(images, 3)  # image, image, text only
    write_llava(tmp_path, rows)
    ds = LlavaJsonlDataset(path, images, encoder, SMALL)
    samples = [ds.sample_of_line(j) for j in (0, 2, 1)]  # image, text, image
    batch = MultimodalCollator(pad_id=EOS, image_shape=(3, 32, 32))(samples)
    lengths = [len(s["tokens"]) for s in samples]
    width = max(lengths)
    assert batch.tokens.shape == (3, width - 1) and batch.labels.shape == (3, width - 1)
    assert batch.image_counts.tolist() == [1, 0, 1]
    assert batch.image_offsets.tolist() == [0, 1, 1]
    assert batch.pixel_values.shape == (2, 3, 32, 32)
    assert torch.equal(batch.pixel_values[1], samples[2]["pixel_values"][0])
    assert batch.lengths.tolist() == [n - 1 for n in lengths]
    for r, s in enumerate(samples):
        n = lengths[r]
        assert batch.tokens[r, :n - 1].tolist() == s["tokens"][:-1].tolist()
        assert batch.labels[r, :n - 1].tolist() == s["tokens"][1:].tolist()
        assert batch.loss_mask[r].tolist() == s["targets"][1:].tolist() + [0] * (width - n)
        assert (batch.tokens[r, n - 1:] == EOS).all()
        assert ((batch.tokens[r] == IMG).sum() == s["num_images"])
    assert batch.attention_mask is None
    assert batch.position_ids[0].tolist() == list(range(width - 1))
    # a fixed length, a batch without images, and micro-batches joined for the pipeline
    fixed = MultimodalCollator(pad_id=EOS, seq_length=48, image_shape=(3, 32, 32))
    text_only = fixed([samples[1]])
    assert text_only.tokens.shape == (1, 48) and text_only.pixel_values.shape == (0, 3, 32, 32)
    joined = MultimodalBatch.cat([fixed(samples[:2]), text_only])
    assert joined.image_counts.tolist() == [1, 0, 0] and joined.pixel_values.shape == (1, 3, 32, 32)
    with pytest.raises(ValueError, match="more than seq_length"):
        MultimodalCollator(pad_id=EOS, seq_length=4)(samples)


# ------------------------------------------------------------------------------ several images per sample

TWO_IMAGE_CONV = [{"from": "human", "value": "<image>\nwhat is this ?"}, {"from": "gpt", "value": "a cat ."},
                  {"from": "human", "value": "<image>\ndescribe"}, {"from": "gpt", "value": "a dog ."}]


def multi_image_rows(images: str) -> list:
    """Line 1: two images (one <image> in each human turn), line 2: one image, line 3: text only."""
    a = save_image(images, "sub/a.jpg", noise_image("RGB", 41, 29, seed=11))
    b = save_image(images, "sub/b.png", noise_image("RGBA", 23, 57, seed=12))
    c = save_image(images, "sub/c.png", noise_image("L", 30, 30, seed=13))
    return [{"id": "two", "image": [a, b], "conversations": TWO_IMAGE_CONV},
            {"id": "one", "image": c, "conversations": CONV},
            {"id": "text", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]}]


@pytest.mark.parametrize("mode", ["native", "split"])
def test_several_images_per_sample(tmp_path, tokenizers, mode):
    path, images = write_llava(tmp_path, [])
    write_llava(tmp_path, multi_image_rows(images))
    enc = ConversationEncoder(tokenizers[mode], seq_length=48, image_token_id=None if mode == "native" else IMG)
    ds = LlavaJsonlDataset(path, images, enc, SMALL, seed=0)
    samples = [ds.sample_of_line(j) for j in range(3)]
    assert [s["id"] for s in samples] == ["two", "one", "text"]
    assert [s["num_images"] for s in samples] == [2, 1, 0]
    assert samples[0]["pixel_values"].shape == (2, 3, 32, 32) and samples[2]["pixel_values"].shape == (0, 3, 32, 32)
    # megatrain's template, turn by turn; the i-th <image> is the i-th path, the loss on the answers only
    two = [USR, NL, IMG, NL, WHAT, SP, IS, SP, THIS, SP, Q, NL, AST, NL, A, SP, CAT, SP, DOT, NL,
           USR, NL, IMG, NL, DESCRIBE, NL, AST, NL, A, SP, DOG, SP, DOT, NL, EOS]
    two_targets = [0] * 14 + [1] * 6 + [0] * 8 + [1] * 7
    text = [USR, NL, HELLO, NL, AST, NL, HI, NL, EOS]
    text_targets = [0] * 6 + [1] * 3
    assert samples[0]["tokens"].tolist() == two and samples[0]["targets"].tolist() == two_targets
    assert samples[1]["tokens"].tolist() == CONV_TOKENS and samples[1]["targets"].tolist() == CONV_TARGETS
    assert samples[2]["tokens"].tolist() == text and samples[2]["targets"].tolist() == text_targets

    batch = MultimodalCollator(pad_id=EOS, image_shape=(3, 32, 32))(samples)
    width = len(two)
    assert batch.tokens.shape == (3, width - 1)
    assert batch.image_counts.tolist() == [2, 1, 0] and batch.image_offsets.tolist() == [0, 2, 3]
    # the batch's images in reading order: sample 0's a then b, then sample 1's c
    expected_pixels = torch.stack([SMALL(Image.open(Path(images) / rel)) for rel in ("sub/a.jpg", "sub/b.png",
                                                                                     "sub/c.png")])
    assert torch.equal(batch.pixel_values, expected_pixels)
    assert [torch.nonzero(batch.tokens[r] == IMG).flatten().tolist() for r in range(3)] == [[2, 22], [2], []]
    pad = lambda row, n: row + [n] * (width - len(row))  # noqa: E731
    assert batch.tokens.tolist() == [two[:-1], pad(CONV_TOKENS, EOS)[:-1], pad(text, EOS)[:-1]]
    assert batch.labels.tolist() == [two[1:], pad(CONV_TOKENS, EOS)[1:], pad(text, EOS)[1:]]
    assert batch.loss_mask.tolist() == [two_targets[1:], pad(CONV_TARGETS, 0)[1:], pad(text_targets, 0)[1:]]
    # through the dataset's order and a DataLoader the same samples come out (by id)
    loader = DataLoader(ds, batch_size=1, collate_fn=lambda x: x[0])
    by_id = {s["id"]: s for s in loader}
    assert torch.equal(by_id["two"]["pixel_values"], expected_pixels[:2])
    assert by_id["two"]["tokens"].tolist() == two
    # a list of one path is one image
    one_list = tmp_path / "one.jsonl"
    one_list.write_text(json.dumps({"image": ["sub/c.png"], "conversations": CONV}) + "\n")
    s = LlavaJsonlDataset(str(one_list), images, enc, SMALL)[0]
    assert s["num_images"] == 1 and torch.equal(s["pixel_values"], expected_pixels[2:])
    # pre-expanded: each image's run of ids
    s = LlavaJsonlDataset(path, images, ConversationEncoder(tokenizers[mode], 48, IMG, num_image_tokens=3),
                          SMALL).sample_of_line(0)
    assert s["tokens"].tolist() == two[:2] + [IMG] * 3 + two[3:22] + [IMG] * 3 + two[23:]
    assert not (s["targets"][s["tokens"] == IMG]).any()


def test_several_images_bad_ones_and_length(tmp_path, encoder):
    path, images = write_llava(tmp_path, [])
    rows = multi_image_rows(images)
    rows.insert(1, {"id": "bad", "image": ["sub/a.jpg", "sub/missing.png"], "conversations": TWO_IMAGE_CONV})
    write_llava(tmp_path, rows)  # line 2: its second image is missing
    strict = LlavaJsonlDataset(path, images, encoder, SMALL, seed=0)
    with pytest.raises(MultimodalDataError, match=rf"^--data-path {re.escape(path)}:2: image "
                                                  rf"{re.escape(images)}/sub/missing.png: no such file$") as info:
        strict.sample_of_line(1)
    assert info.value.kind == "image"
    with pytest.warns(UserWarning, match="skipped: .*:2: image .*missing.png"):
        lenient = LlavaJsonlDataset(path, images, encoder, SMALL, seed=0, skip_bad_samples=True)
        ids = [lenient[i]["id"] for i in range(len(lenient))]
    assert "bad" not in ids and sorted(lenient.bad_lines) == [2]
    with pytest.warns(UserWarning, match=r"1 lines with an unreadable image are left out"):
        checked = LlavaJsonlDataset(path, images, encoder, SMALL, skip_bad_samples=True, check_images=True)
    assert checked.num_lines == 3 and sorted(checked.bad_lines) == [2]
    with pytest.raises(MultimodalDataError, match=r"d.jsonl:2: image .*sub/missing.png: no such file"):
        LlavaJsonlDataset(path, images, encoder, SMALL, check_images=True)
    # the second image's tokens past seq_length + 1: kind length, skippable as for one image
    tight = ConversationEncoder(encoder.tokenizer, seq_length=24, num_image_tokens=4)
    ds = LlavaJsonlDataset(path, images, tight, SMALL, seed=0)
    with pytest.raises(MultimodalDataError, match=r":1: the last image's tokens end at token 29 but a sample "
                                                  r"holds seq_length \+ 1 = 25 tokens .* before the images$") as info:
        ds.sample_of_line(0)
    assert info.value.kind == "length"
    with pytest.warns(UserWarning, match="skipped: "):
        lenient = LlavaJsonlDataset(path, images, tight, SMALL, seed=0, skip_bad_samples=True)
        ids = {lenient[i]["id"] for i in range(len(lenient))}
    assert ids == {"one", "text"} and sorted(lenient.bad_lines) == [1, 2]


# -------------------------------------------------------------------------------------------- energon


def write_shards(root: Path, samples: list[tuple[str, Image.Image, dict | str]], per_shard: int) -> list[str]:
    shards = []
    for s in range(0, len(samples), per_shard):
        name = f"shard_{s // per_shard:03d}.tar"
        with tarfile.open(root / name, "w") as tar:
            for key, image, meta in samples[s:s + per_shard]:
                buf = io.BytesIO()
                image.save(buf, format="JPEG", quality=90)
                text = ("txt", meta.encode()) if isinstance(meta, str) else ("json", json.dumps(meta).encode())
                for ext, data in (("jpg", buf.getvalue()), text):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        shards.append(name)
    return shards


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")  # energon's loader, on CPU
def test_energon_webdataset_reads_into_the_jsonl_samples(tmp_path, encoder):
    pytest.importorskip("megatron.energon")
    from megatrain.data.multimodal import energon as mm_energon
    import megatron.energon as energon

    root = tmp_path / "wds"
    root.mkdir()
    items = []
    for k in range(6):
        q, a = QUESTIONS[k % len(QUESTIONS)]
        items.append((f"{k:06d}", noise_image("RGB", 60 + 7 * k, 45 + 3 * k, seed=20 + k),
                      {"question": q, "answers": [a, "hi"]}))
    shards = write_shards(root, items, per_shard=3)
    mm_energon.prepare_dataset(str(root), shards, "VQASample",
                               {"image": "jpg", "context": "json[question]", "answers": "json[answers]"})
    assert (root / ".nv-meta" / "dataset.yaml").exists() and (root / ".nv-meta" / "split.yaml").exists()

    # the same samples as a LLaVA jsonl over the same JPEG files
    images = tmp_path / "images"
    images.mkdir()
    rows = []
    for key, _, meta in items:
        with tarfile.open(root / shards[int(key) // 3]) as tar:
            (images / f"{key}.jpg").write_bytes(tar.extractfile(f"{key}.jpg").read())
        rows.append({"id": key, "image": f"{key}.jpg", "conversations": [
            {"from": "human", "value": "<image>\n" + meta["question"]}, {"from": "gpt", "value": meta["answers"][0]}]})
    (tmp_path / "same.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = LlavaJsonlDataset(str(tmp_path / "same.jsonl"), str(images), encoder, SMALL)
    expected = {s["id"]: s for s in (ds.sample_of_line(j) for j in range(ds.num_lines))}

    task_encoder = mm_energon.LlavaTaskEncoder(encoder, SMALL)
    train = mm_energon.get_train_dataset(str(root), task_encoder, shuffle_buffer_size=None,
                                         max_samples_per_sequence=None)
    seen = {}
    # (energon's gc.collect every 10 samples, off: it costs more than this whole tiny dataset)
    for sample in energon.get_savable_loader(train, gc_collect_every_n_steps=0):
        key = sample["id"].rsplit("/", 1)[-1]
        seen[key] = sample
        if len(seen) == len(items) or len(seen) > 50:
            break
    assert set(seen) == set(expected)
    for key, s in seen.items():
        assert np.asarray(s["tokens"]).tolist() == expected[key]["tokens"].tolist(), key
        assert np.asarray(s["targets"]).tolist() == expected[key]["targets"].tolist(), key
        assert torch.equal(torch.as_tensor(s["pixel_values"]), expected[key]["pixel_values"]), key

    # batched by energon into megatrain's batch
    batched = mm_energon.get_train_dataset(str(root), task_encoder, batch_size=2, shuffle_buffer_size=None,
                                           max_samples_per_sequence=None)
    batch = next(iter(energon.get_savable_loader(batched, gc_collect_every_n_steps=0)))
    assert isinstance(batch, MultimodalBatch)
    assert batch.image_counts.tolist() == [1, 1] and batch.pixel_values.shape == (2, 3, 32, 32)

    # captions (KEY.txt) as CaptioningSample: <image> and the caption prompt, the caption as the answer
    caps = tmp_path / "caps"
    caps.mkdir()
    shards = write_shards(caps, [("c0", noise_image("L", 90, 50, seed=40), "a cat ."),
                                 ("c1", noise_image("RGB", 40, 70, seed=41), "a red bus .")], per_shard=2)
    mm_energon.prepare_dataset(str(caps), shards, "CaptioningSample", {"image": "jpg", "caption": "txt"})
    captions = mm_energon.LlavaTaskEncoder(encoder, SMALL, caption_prompt="describe")
    loader = energon.get_savable_loader(mm_energon.get_train_dataset(
        str(caps), captions, shuffle_buffer_size=None, max_samples_per_sequence=None), gc_collect_every_n_steps=0)
    for sample, _ in zip(loader, range(2)):
        key = sample["id"].rsplit("/", 1)[-1]
        caption = "a cat ." if key == "c0" else "a red bus ."
        expected = encoder.encode([{"from": "human", "value": "<image>\ndescribe"}, {"from": "gpt", "value": caption}],
                                  1, "")
        assert np.asarray(sample["tokens"]).tolist() == expected.tokens.tolist()
        with tarfile.open(caps / shards[0]) as tar:
            image = Image.open(io.BytesIO(tar.extractfile(f"{key}.jpg").read()))
            assert torch.equal(torch.as_tensor(sample["pixel_values"][0]), SMALL(image))
