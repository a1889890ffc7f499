"""The LLaVA log line's FLOPs count the images and expanded positions each iteration ran: a
micro-batch's FLOPs (as the loader gives it, on the host) equal the formula written out for its rows,
their expanded length and its images (two per sample, mixed counts, text already expanded, the
pipeline's fixed length), and the trainer's per-iteration FLOPs over a run of two-image samples are
those of the batches it read; other families keep their formula."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from megatrain.data.multimodal import MultimodalCollator
from megatrain.models.llava.flops import (batch_flops, batch_flops_counter, expanded_length,
                                          num_floating_point_operations)
from megatrain.models.registry import get_family
from megatrain.training.flops import CountedFlops
from megatrain.training.main import parse_family_args
from megatrain.training.trainer import Trainer
from tests.unit.test_llava_family import vlm_args
from tests.unit.test_llava_model import IMAGE, llava_config
from tests.unit.test_multimodal_data import write_tokenizer


def written_out(cfg, b: int, S: int, N: int) -> float:
    """Megatron's GPT formula over b rows of S positions, plus N images through the encoder (patch
    embedding and layers) and the MLP projector, every part trained (6 per multiply-add)."""
    lm, v = cfg.language, cfg.vision
    h, L, V, n, g, d, F = (lm.hidden_size, lm.num_layers, lm.vocab_size, lm.num_attention_heads, lm.num_query_groups,
                           lm.kv_channels, lm.ffn_hidden_size)
    E = 3 if lm.swiglu else 2
    language = b * S * (6 * h * E * F * L + 6 * L * (h * d * (n + 2 * g) + d * n * h) + 6 * h * V) \
        + 6 * b * S * S * L * n * d
    hv, nv, gv, dv, Fv = v.hidden_size, v.num_attention_heads, v.num_query_groups, v.kv_channels, v.ffn_hidden_size
    P, T, Lr = v.num_patches, v.seq_length, cfg.vision_layers_run
    patch = 4 * P * v.num_channels * v.patch_dim ** 2 * hv  # its input, the image, needs no gradient
    layers = 6 * T * Lr * (hv * dv * (nv + 2 * gv) + dv * nv * hv + 2 * hv * Fv) + 12 * T * T * Lr * nv * dv
    Fp = cfg.projector_ffn_hidden_size or lm.hidden_size
    projector = 6 * cfg.tokens_per_image * (cfg.projector_input_size * Fp + Fp * lm.hidden_size)
    return float(language + N * (patch + layers + projector))


def sample(tokens: list[int], k: int) -> dict:
    return {"tokens": np.asarray(tokens), "targets": np.ones(len(tokens), dtype=np.int64),
            "pixel_values": torch.zeros(k, 3, 16, 16), "num_images": k}


def test_a_micro_batch_with_two_images_per_sample_is_the_written_out_formula():
    cfg = llava_config()
    assert cfg.projector_type == "mlp" and cfg.tokens_per_image > 1
    T = cfg.tokens_per_image
    collate = MultimodalCollator(pad_id=0, image_shape=(3, 16, 16))
    rows = [[1, IMAGE, 2, IMAGE, 3, 4, 5], [1, IMAGE, IMAGE, 6, 7], [1, 2, IMAGE, 3, IMAGE, 4, 5, 6, 7]]
    batch = collate([sample(r, 2) for r in rows])
    s = batch.tokens.shape[1]
    assert s == 8 and batch.image_counts.tolist() == [2, 2, 2]
    S = s + 2 * (T - 1)  # every row's two placeholders, each expanded to T positions
    assert expanded_length(cfg, batch.tokens, batch.image_counts) == S
    assert batch_flops(cfg, batch) == pytest.approx(written_out(cfg, 3, S, 6), rel=1e-12)
    assert batch_flops(cfg, batch) == num_floating_point_operations(cfg, 3, S, images_per_sample=2)
    # more than the one-image formula of the same rows
    assert batch_flops(cfg, batch) > num_floating_point_operations(cfg, 3, s + T - 1)

    # mixed: 2, 1 and 0 images; the padded rows, the one with the most images expanded, set the length
    batch = collate([sample([1, IMAGE, 2, IMAGE, 3], 2), sample([1, IMAGE, 2, 3, 4, 5, 6], 1), sample([1, 2, 3], 0)])
    s = batch.tokens.shape[1]
    S = s + 2 * (T - 1)
    assert expanded_length(cfg, batch.tokens, batch.image_counts) == S
    assert batch_flops(cfg, batch) == pytest.approx(written_out(cfg, 3, S, 3), rel=1e-12)
    # text only: the language model alone, at the text's length
    batch = collate([sample([1, 2, 3, 4], 0), sample([1, 2], 0)])
    assert batch_flops(cfg, batch) == pytest.approx(written_out(cfg, 2, 3, 0), rel=1e-12)
    # the text already expanded (T ids per image): its own length
    expanded = [1] + [IMAGE] * T + [2] + [IMAGE] * T + [3]
    batch = collate([sample(expanded, 2), sample(expanded, 2)])
    assert expanded_length(cfg, batch.tokens, batch.image_counts) == len(expanded) - 1
    assert batch_flops(cfg, batch) == pytest.approx(written_out(cfg, 2, len(expanded) - 1, 4), rel=1e-12)
    # the family's counter for a run: the expanded length, or the pipeline's fixed one
    batch = collate([sample(r, 2) for r in rows])
    one = argparse.Namespace(pipeline_model_parallel_size=1, seq_length=20)
    assert batch_flops_counter(one, cfg)(batch) == batch_flops(cfg, batch)
    pp = argparse.Namespace(pipeline_model_parallel_size=2, seq_length=20)
    assert batch_flops_counter(pp, cfg)(batch) == pytest.approx(written_out(cfg, 3, 20 - 1 + T, 6), rel=1e-12)


def test_counted_flops_adds_up_what_was_read():
    counter = CountedFlops(iter([1, 2, 3]), lambda x: 10.0 * x)
    assert next(counter) == 1 and next(counter) == 2
    assert counter.take() == 30.0 and counter.take() == 0.0
    assert list(counter) == [3] and counter.take() == 30.0


@pytest.fixture(autouse=True)
def _one_process():
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)


def write_two_image_data(root: Path, n: int = 16) -> dict[str, str]:
    tok = write_tokenizer(root / "tok", True)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    with open(root / "d.jsonl", "w") as f:
        for k in range(n):
            paths = []
            for i in range(2):
                Image.new("RGB", (20 + k % 5, 18 + i), (30 * i, 100, 200 - 7 * k)).save(images / f"{k}_{i}.png")
                paths.append(f"{k}_{i}.png")
            f.write(json.dumps({"id": str(k), "image": paths, "conversations": [
                {"from": "human", "value": "<image>\n<image>\nwhat is this ?"},
                {"from": "gpt", "value": "a cat ." if k % 2 else "a dog ."}]}) + "\n")
    return {"tok": tok, "data": str(root / "d.jsonl"), "images": str(images)}


def test_the_log_lines_flops_count_two_images_per_sample(tmp_path, monkeypatch):
    paths = write_two_image_data(tmp_path)
    args = parse_family_args("llava", [*vlm_args(paths), "--train-iters", "4", "--log-interval", "2"],
                             prog="pretrain_vlm.py")
    seen: list[float] = []
    original = Trainer._iteration_flops

    def record(self, stats):
        seen.append(original(self, stats))
        return seen[-1]

    monkeypatch.setattr(Trainer, "_iteration_flops", record)
    t = Trainer(args, family="llava")
    assert isinstance(t.train_iter, CountedFlops)
    cfg = t.model_config
    T = cfg.tokens_per_image
    # every sample the same conversation: its text tokens (the collator pads to the longest, itself)
    s = len(t.train_ds.sample_of_line(0)["tokens"]) - 1
    t.train()
    t.close()
    S = s + 2 * (T - 1)  # the language model's positions per row: two placeholders expanded
    per_iteration = num_floating_point_operations(cfg, args.global_batch_size, S, images_per_sample=2)
    assert seen == [pytest.approx(per_iteration, rel=1e-12)] * 2  # two log lines, each the mean of its iterations
    # the nominal formula: --seq-length of text with one image per sample, not what ran
    assert t.flops_per_iteration == num_floating_point_operations(cfg, 8, args.seq_length - 1 + T)
    assert per_iteration > num_floating_point_operations(cfg, 8, s + T - 1)  # one image of the same rows


def test_other_families_keep_their_formula():
    for name in ("gpt", "bert", "t5"):
        assert get_family(name).batch_flops is None
