"""Packing of LLaVA samples (``--packing-buffer-size``, ``--packing-seq-length``;
``megatrain/data/multimodal/packing.py``): a packed micro-batch's per-token losses equal the same
samples' losses computed one by one (text-only, one-image and two-image samples in one row; RoPE and
learned positions), the packer is Megatron's greedy knapsack per buffer, deterministic and resumable
from any pack, long samples are cut as Megatron cuts them or refused in one line, and the flags'
bad combinations are refused."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from megatrain.data.loader import build_pretraining_data_loader
from megatrain.data.multimodal import CLIPImageConfig, CLIPImageProcessor, ConversationEncoder, LlavaJsonlDataset
from megatrain.data.multimodal.collate import MultimodalCollator
from megatrain.data.multimodal.errors import MultimodalDataError
from megatrain.data.multimodal.packing import (PackedSamples, fit_for_packing, pack_selected_samples, packed_attention,
                                               sample_cost, select_samples_to_pack)
from megatrain.data.tokenizers import TokenizerConfig, build_tokenizer
from megatrain.models.gpt import GPTConfig
from megatrain.models.llava import LlavaConfig, LlavaModel, VisionConfig
from megatrain.models.llava.flags import check_packing_args
from megatrain.models.llava.objective import LlavaObjective
from tests.unit.test_multimodal_data import write_tokenizer

IMAGE_ID = -200  # Megatron's placeholder id, as pretrain_vlm.py's data
TOKENS_PER_IMAGE = 16  # 16 x 16 images of 4-pixel patches, no class token

QUESTIONS = ["what is this ?", "describe this", "what is this long long bus ?", "hello"]
ANSWERS = ["a red bus .", "a cat .", "a dog . a long long red bus .", "hi ."]


def write_lines(root: Path, n: int = 12) -> dict:
    """A jsonl of ``n`` lines: two-image, one-image and text-only samples of several lengths."""
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for k in range(n):
        q, a = QUESTIONS[k % 4], ANSWERS[(k * 3) % 4]
        kind = k % 3  # 0: text only, 1: one image, 2: two images
        for i in range(kind):
            Image.new("RGB", (17 + k, 15 + i), ((40 * k) % 256, 90 * i, 200 - 10 * k)).save(images / f"{k}_{i}.png")
        row: dict = {"id": f"s{k}", "conversations": [
            {"from": "human", "value": "<image>\n" * kind + q}, {"from": "gpt", "value": a}]}
        if kind == 2:
            row["conversations"] = [{"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": a},
                                    {"from": "human", "value": "and this ? <image>"},
                                    {"from": "gpt", "value": "a cat ."}]
        if kind:
            row["image"] = [f"{k}_{i}.png" for i in range(kind)] if kind == 2 else f"{k}_0.png"
        rows.append(row)
    (root / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"data": str(root / "d.jsonl"), "images": str(images), "tok": write_tokenizer(root / "tok", True)}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    paths = write_lines(tmp_path_factory.mktemp("pack"))
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=paths["tok"]))
    encoder = ConversationEncoder(tok, seq_length=64, image_token_id=IMAGE_ID)
    processor = CLIPImageProcessor(CLIPImageConfig.default(16))
    return {**paths, "tokenizer": tok, "encoder": encoder, "processor": processor}


def _jsonl(data, num_samples=None, seed=3):
    return LlavaJsonlDataset(data["data"], data["images"], data["encoder"], data["processor"],
                             num_samples=num_samples, seed=seed)


def _collator(data):
    return MultimodalCollator(pad_id=int(data["tokenizer"].eod), image_shape=(3, 16, 16),
                              tokens_per_image=TOKENS_PER_IMAGE, image_token_id=IMAGE_ID)


def _model(vocab: int, positions: str) -> LlavaModel:
    torch.manual_seed(0)
    cfg = LlavaConfig(
        language=GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=vocab, ffn_hidden_size=64,
                           max_position_embeddings=256, position_embedding_type=positions, hidden_dropout=0.0,
                           attention_dropout=0.0, init_method_std=0.2),
        vision=VisionConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, patch_dim=4,
                            img_h=16, img_w=16, hidden_dropout=0.0, attention_dropout=0.0),
        image_token_id=IMAGE_ID, vision_feature_select_strategy="default")
    assert cfg.tokens_per_image == TOKENS_PER_IMAGE
    model = LlavaModel(cfg)
    model.init_weights(seed=5)
    return model.eval()


# ---- the losses -----------------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["rope", "learned_absolute"])
def test_packed_per_token_losses_equal_the_samples_one_by_one(data, positions):
    ds = _jsonl(data)
    samples = [ds[i] for i in range(8)]
    assert {s["num_images"] for s in samples} == {0, 1, 2}
    rows = [[0, 1, 2, 3], [4, 5, 6], [7]]  # mixed kinds in a row, two images in rows 0 and 1
    packed = _collator(data)([pack_selected_samples([samples[i] for i in row]) for row in rows])
    assert packed.segments is not None and packed.segments.max() == 4
    model = _model(data["tokenizer"].vocab_size + 8, positions)
    collate, objective = _collator(data), LlavaObjective(model.config)
    with torch.no_grad():
        out = objective.forward(model, packed)
        assert out.shape == packed.segments.shape
        total, count = 0.0, 0.0
        for r, row in enumerate(rows):
            offset = 0
            for i in row:
                alone = collate([samples[i]])
                ref = objective.forward(model, alone)[0]
                cost = sample_cost(samples[i]["tokens"], samples[i]["num_images"], IMAGE_ID, TOKENS_PER_IMAGE)
                assert ref.shape[0] == cost - 1
                torch.testing.assert_close(out[r, offset:offset + cost - 1], ref, atol=1e-5, rtol=0)
                assert float(ref.abs().sum()) > 0
                if offset + cost - 1 < out.shape[1]:  # the sample's last token predicts across the boundary: no loss
                    assert float(out[r, offset + cost - 1]) == 0.0
                offset += cost
                total, count = total + float(ref.sum()), count + float(alone.loss_mask.sum())
            assert float(out[r, offset:].abs().sum()) == 0.0  # padding
        # the micro-batch's loss (the mean over its answer tokens) is the unpacked batch's
        (loss_sum, tokens), = objective.losses(out, objective.loss_target(packed))
        unpacked = collate(samples)
        (ref_sum, ref_tokens), = objective.losses(objective.forward(model, unpacked), objective.loss_target(unpacked))
        assert float(tokens) == float(ref_tokens) == count
        assert abs(float(loss_sum) / float(tokens) - float(ref_sum) / float(ref_tokens)) < 1e-5
        assert abs(float(loss_sum) - total) < 1e-4
        # the test can fail: without the block-diagonal mask and restarted positions the losses differ
        labels = packed.labels.masked_fill(packed.loss_mask == 0, -100)
        naive = model(packed.tokens, packed.pixel_values, labels=labels)
        assert float((naive - out).abs().max()) > 1e-3


def test_packed_gradients_equal_the_unpacked_batch(data):
    ds = _jsonl(data)
    samples = [ds[i] for i in range(6)]
    model = _model(data["tokenizer"].vocab_size + 8, "rope")
    collate, objective = _collator(data), LlavaObjective(model.config)

    def grads(batch):
        model.zero_grad()
        objective.forward(model, batch).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    packed = grads(collate([pack_selected_samples(samples[:4]), pack_selected_samples(samples[4:])]))
    unpacked = grads(collate(samples))
    assert packed.keys() == unpacked.keys() and any(n.startswith("vision_model.") for n in packed)
    for name in packed:
        torch.testing.assert_close(packed[name], unpacked[name], atol=1e-5, rtol=1e-4, msg=name)


def test_packed_attention_is_block_diagonal_with_restarting_positions():
    segments = torch.tensor([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    positions, mask = packed_attention(segments)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    assert mask.shape == (2, 1, 8, 8)
    m = mask[0, 0]
    assert m[4].tolist() == [False, False, False, True, True, False, False, False]
    assert m[2].tolist() == [True, True, True, False, False, False, False, False]
    assert mask[1, 0].tolist() == torch.ones(8, 8, dtype=torch.bool).tril().tolist()
    assert packed_attention(torch.tensor([[1, 1, 0]]))[1] is None  # one sample per row: causal is enough


# ---- the packer -----------------------------------------------------------------------------------


def test_select_samples_to_pack_is_megatrons_greedy_knapsack():
    # sorted 2(3) 3(1) 5(0) 7(4) 8(2): [8, 2], then [7, 3], then [5]
    assert select_samples_to_pack([5, 3, 8, 2, 7], 10) == [[2, 3], [4, 1], [0]]
    assert select_samples_to_pack([4, 4, 4], 8) == [[2, 1], [0]]  # of equal ones the later first
    assert select_samples_to_pack([], 8) == []
    with pytest.raises(ValueError, match="more than the packing capacity 8"):
        select_samples_to_pack([3, 9], 8)


def _costs(ds, indices):
    return [sample_cost(ds[i]["tokens"], ds[i]["num_images"], IMAGE_ID, TOKENS_PER_IMAGE) for i in indices]


def test_packer_buffers_deterministic_and_resumable(data):
    inner = _jsonl(data, num_samples=60)

    def packed():
        source = _jsonl(data, num_samples=60)
        source.collate_fn = _collator(data)  # as pretrain_vlm.py's datasets: the packed dataset takes it
        return PackedSamples(source, packing_seq_length=100, buffer_size=5,
                             tokens_per_image=TOKENS_PER_IMAGE, image_token_id=IMAGE_ID, num_samples=12)

    ds = packed()
    packs = [ds.pack_indices(j) for j in range(12)]
    seen: list[int] = []
    for pack in packs:
        assert sum(_costs(inner, pack)) <= 100
        seen.extend(pack)
    # consecutive buffers of 5, each one packed by the knapsack on its samples' costs
    buffers = sorted(set(seen))
    assert buffers == list(range(len(buffers))) and len(buffers) % 5 == 0
    expected = []
    for start in range(0, len(buffers), 5):
        groups = select_samples_to_pack(_costs(inner, range(start, start + 5)), 100)
        expected += [[start + i for i in g] for g in groups]
    assert packs == expected[:12]
    assert any(len(p) > 1 for p in packs) and any(inner[i]["num_images"] == 2 for p in packs for i in p)
    # a fresh dataset (a resumed run) asked for pack 9 first gives the same pack and samples
    again = packed()
    sample = again[9]
    assert again.pack_indices(9) == packs[9]
    ref = ds[9]
    assert sample["tokens"].tolist() == ref["tokens"].tolist()
    assert sample["segments"].tolist() == ref["segments"].tolist()
    assert torch.equal(sample["pixel_values"], ref["pixel_values"]) and sample["id"] == ",".join(
        inner[i]["id"] for i in packs[9])
    # the loader resumed from a consumed count reads the tail of the uninterrupted run's micro-batches
    def batches(consumed):
        loader = build_pretraining_data_loader(packed(), consumed, micro_batch_size=2, data_parallel_rank=0,
                                               data_parallel_size=1, num_workers=0)
        return [(b.tokens.tolist(), b.segments.tolist()) for b in loader]

    whole, resumed = batches(0), batches(6)
    assert len(whole) == 6 and resumed == whole[3:]


def test_packer_reads_whole_samples_of_a_dataset_without_text_sample(data):
    class Whole(torch.utils.data.Dataset):  # as the energon reader: whole samples only, in order
        def __init__(self):
            self.inner, self.reads = _jsonl(data, num_samples=40), []

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            self.reads.append(i)
            return self.inner[i]

    whole = Whole()
    a = PackedSamples(whole, packing_seq_length=100, buffer_size=5, tokens_per_image=TOKENS_PER_IMAGE,
                      image_token_id=IMAGE_ID, num_samples=6)
    b = PackedSamples(_jsonl(data, num_samples=40), packing_seq_length=100, buffer_size=5,
                      tokens_per_image=TOKENS_PER_IMAGE, image_token_id=IMAGE_ID, num_samples=6)
    for j in range(6):
        assert a[j]["tokens"].tolist() == b[j]["tokens"].tolist()
    assert whole.reads == sorted(whole.reads) and len(whole.reads) == len(set(whole.reads))  # each read once


# ---- long samples and flags ---------------------------------------------------------------------------


def test_a_long_sample_is_cut_as_megatron_or_refused_naming_the_flag_and_line(data, tmp_path):
    ds = _jsonl(data)
    text = next(ds[i] for i in range(len(ds)) if ds[i]["num_images"] == 0)
    capacity = len(text["tokens"]) - 2
    packer = PackedSamples(ds, packing_seq_length=capacity, buffer_size=4, tokens_per_image=TOKENS_PER_IMAGE,
                           image_token_id=IMAGE_ID, num_samples=3)
    fitted = packer._fit(text)
    assert fitted["tokens"].tolist() == text["tokens"][:capacity].tolist()  # Megatron's truncation
    assert fitted["targets"].tolist() == text["targets"][:capacity].tolist()
    image = next(ds[i] for i in range(len(ds)) if ds[i]["num_images"] == 2)
    cost = sample_cost(image["tokens"], 2, IMAGE_ID, TOKENS_PER_IMAGE)
    fitted = fit_for_packing(image, cost - 3, IMAGE_ID, TOKENS_PER_IMAGE, "x")
    assert fitted["tokens"].tolist() == image["tokens"][:-3].tolist()  # the text after the images cut, images whole
    assert sample_cost(fitted["tokens"], 2, IMAGE_ID, TOKENS_PER_IMAGE) == cost - 3
    # an image sample whose images would be cut: one line naming the flag and the file and line
    (tmp_path / "images").mkdir()
    Image.new("RGB", (16, 16), (1, 2, 3)).save(tmp_path / "images" / "x.png")
    lines = [{"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi ."}]},
             {"image": "x.png", "conversations": [{"from": "human", "value": "what is this long long bus ? <image>"},
                                                  {"from": "gpt", "value": "a bus ."}]}]
    (tmp_path / "e.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    bad = LlavaJsonlDataset(str(tmp_path / "e.jsonl"), str(tmp_path / "images"), data["encoder"], data["processor"],
                            seed=0)
    packer = PackedSamples(bad, packing_seq_length=20, buffer_size=2, tokens_per_image=TOKENS_PER_IMAGE,
                           image_token_id=IMAGE_ID, num_samples=2)
    with pytest.raises(MultimodalDataError) as err:
        packer[0]
    msg = str(err.value)
    assert "\n" not in msg and f"{tmp_path / 'e.jsonl'}:2" in msg and "--packing-seq-length 20" in msg, msg
    assert msg.startswith("--data-path "), msg


def test_packing_flags_are_checked():
    def args(**kw):
        base = dict(packing_buffer_size=None, packing_seq_length=0, sequence_parallel=False,
                    pipeline_model_parallel_size=1, context_parallel_size=1)
        return argparse.Namespace(**{**base, **kw})

    assert not check_packing_args(args()) and not check_packing_args(args(packing_buffer_size=0))
    assert check_packing_args(args(packing_buffer_size=8, packing_seq_length=64))
    for kw, text in [(dict(packing_buffer_size=8), "--packing-buffer-size 8 needs --packing-seq-length"),
                     (dict(packing_buffer_size=-1, packing_seq_length=64), "--packing-buffer-size -1: give a positive"),
                     (dict(packing_buffer_size=8, packing_seq_length=64, sequence_parallel=True),
                      "--sequence-parallel"),
                     (dict(packing_buffer_size=8, packing_seq_length=64, pipeline_model_parallel_size=2),
                      "--pipeline-model-parallel-size")]:
        with pytest.raises(ValueError, match=text.replace("?", r"\?")):
            check_packing_args(args(**kw))
