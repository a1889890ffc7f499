"""LLaVA's pipeline stages in one process (fp32, CPU): the micro-batch laid out to the run's fixed length
(:func:`pipeline_batch`), the stages chained by hand (as the schedule passes hidden states) give the
whole LlavaModel's per-token loss and gradients, on text-only rows, one and two images per row and
the schedule's split of the step into micro-batches (images per row); the canonical names of every
stage together are the model's; rows longer than the fixed length are cut, their images' features
kept in their rows; the length rounded up for sequence parallelism. (The real schedule over processes:
tests/distributed/test_llava_pipeline.py.)"""

from __future__ import annotations

import pytest
import torch

from megatrain.data.multimodal.collate import MultimodalBatch
from megatrain.models.common.init import canonical_parameter_name
from megatrain.models.llava import IGNORE_INDEX
from megatrain.models.llava.objective import LlavaObjective
from megatrain.models.llava.stage import LlavaStage, image_rows, pipeline_batch
from megatrain.parallel.pipeline import split_layers, stage_parameter_count
from tests.unit.test_llava_model import IMAGE, images, llava_config, model_of


def _batch(cfg, rows: list[list[int]], counts: list[int], width: int, seed: int = 3) -> MultimodalBatch:
    """Rows of text ids (placeholders included), right-padded with 0 to ``width + 1``; answers: the second half."""
    ids = torch.zeros(len(rows), width + 1, dtype=torch.long)
    mask = torch.zeros(len(rows), width + 1)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, len(row) // 2:len(row)] = 1
    n = sum(counts)
    return MultimodalBatch(tokens=ids[:, :-1], labels=ids[:, 1:], loss_mask=mask[:, 1:] * (ids[:, 1:] != IMAGE),
                           position_ids=torch.arange(width).expand(len(rows), width),
                           pixel_values=images(n, cfg, seed) if n else torch.zeros(0, 3, 16, 16),
                           image_counts=torch.tensor(counts), lengths=torch.tensor([len(r) - 1 for r in rows]))


def _stages(model, cfg, num_stages: int, first_layers: int | None = None) -> list[LlavaStage]:
    split = split_layers(cfg.language.num_layers, num_stages, first=first_layers)
    stages = []
    for s, ids in enumerate(split):
        with torch.device("meta"):
            stage = LlavaStage(cfg, ids, stage_index=s, num_stages=num_stages)
        stage.to_empty(device="cpu")
        whole = dict(model.named_parameters())
        with torch.no_grad():
            for name, p in stage.named_parameters():
                p.copy_(whole[name])
        stages.append(stage)
    return stages


def _through(stages, objective, batch, micro: int) -> torch.Tensor:
    """The per-token losses of the stages chained, micro-batch by micro-batch, as the schedule splits them."""
    first_args, first_kwargs = objective.stage_inputs(batch, first=True, last=len(stages) == 1)
    _, last_kwargs = objective.stage_inputs(batch, first=False, last=True)
    _, mid_kwargs = objective.stage_inputs(batch, first=False, last=False)
    outs = []
    for m in range(batch.tokens.shape[0] // micro):
        cut = slice(m * micro, (m + 1) * micro)
        x = stages[0](*(a[cut] for a in first_args), **{k: v[cut] if v is not None else None
                                                         for k, v in first_kwargs.items()})
        for i, stage in enumerate(stages[1:], 1):
            kw = last_kwargs if i == len(stages) - 1 else mid_kwargs
            x = stage(x, **{k: v[cut] if v is not None else None for k, v in kw.items()})
        outs.append(x)
    return torch.cat(outs)


@pytest.mark.parametrize("style,num_stages,first", [("llama", 2, None), ("gpt2", 2, None), ("gpt2", 3, 0)])
def test_stages_chained_equal_the_whole_model(style, num_stages, first):
    cfg = llava_config(style)
    model = model_of(cfg)
    t = cfg.tokens_per_image
    rows = [[5, IMAGE, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12],  # one image; text only
            [IMAGE, 5, 6, IMAGE, 7, 8, 9], [6, 7, IMAGE, 8, 9]]  # two images; one
    counts = [1, 0, 2, 1]
    batch = _batch(cfg, rows, counts, width=10)
    length = 10 + 2 * t + 2  # longer than any row (padding at the end)
    objective = LlavaObjective(cfg, length)
    laid = pipeline_batch(batch, cfg, length)
    assert laid.tokens.shape == (4, length) and laid.loss_mask.sum() == batch.loss_mask.sum()
    stages = _stages(model, cfg, num_stages, first)
    names = [canonical_parameter_name(n) for s in stages for n, _ in s.named_parameters()]
    assert set(names) == {n for n, _ in model.named_parameters()}
    assert sum(stage_parameter_count([s]) for s in stages) == model.num_parameters()
    # the whole model, one micro-batch of 2 rows at a time (its rows padded to their own longest)
    ref_loss, ref_counts = [], []
    for m in range(2):
        part = MultimodalBatch.cat([_slice(batch, r) for r in (2 * m, 2 * m + 1)])
        out = LlavaObjective(cfg).forward(model, part)
        ref_loss.append(out.float().sum())
        ref_counts.append(part.loss_mask.sum())
    (ref_loss[0] / ref_counts[0] + ref_loss[1] / ref_counts[1]).backward()
    out = _through(stages, objective, laid, micro=2)
    assert out.shape == (4, length)
    target = objective.loss_target(laid)
    loss = sum(objective.losses(out[2 * m:2 * m + 2], target[2 * m:2 * m + 2])[0][0]
               / target[2 * m:2 * m + 2].sum() for m in range(2))
    assert loss.item() == pytest.approx((ref_loss[0] / ref_counts[0] + ref_loss[1] / ref_counts[1]).item(), rel=1e-6)
    loss.backward()
    grads = {canonical_parameter_name(n): p.grad for s in stages for n, p in s.named_parameters()}
    tied = "language_model.embedding.word_embeddings.weight"
    for name, p in model.named_parameters():
        g = grads[name]
        if name == tied and not cfg.language.untie_embeddings_and_output_weights:  # summed by the pipeline
            g = sum(p2.grad for s in stages for n2, p2 in s.named_parameters() if n2 == name)
        if p.grad is None:  # a part the forward does not reach (encoder layers past the feature layer)
            assert g is None, name
            continue
        assert torch.allclose(g, p.grad, rtol=1e-5, atol=1e-7), name


def _slice(batch: MultimodalBatch, r: int) -> MultimodalBatch:
    start = int(batch.image_counts[:r].sum())
    n = int(batch.image_counts[r])
    return MultimodalBatch(tokens=batch.tokens[r:r + 1], labels=batch.labels[r:r + 1],
                           loss_mask=batch.loss_mask[r:r + 1], position_ids=batch.position_ids[r:r + 1],
                           pixel_values=batch.pixel_values[start:start + n], image_counts=batch.image_counts[r:r + 1],
                           lengths=batch.lengths[r:r + 1])


def test_image_rows_keep_each_rows_images():
    pixels = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 3, 2, 2)
    rows = image_rows(pixels, torch.tensor([2, 0, 1]))
    assert rows.shape == (3, 2, 3, 2, 2)
    assert rows[:, :, 0, 0, 0].tolist() == [[0.0, 1.0], [0.0, 0.0], [2.0, 0.0]]
    assert image_rows(torch.zeros(0, 3, 2, 2), torch.tensor([0, 0])).shape == (2, 0, 3, 2, 2)


def test_rows_longer_than_the_length_are_cut_with_their_images_in_place():
    cfg = llava_config("gpt2")
    model = model_of(cfg)
    t = cfg.tokens_per_image
    rows = [[5, IMAGE, 7, 8, IMAGE, 9, 10, 11], [IMAGE, 3, 4, 5]]
    batch = _batch(cfg, rows, [2, 1], width=8)
    length = 1 + t + 3  # row 0's second image keeps its first position only
    with pytest.warns(UserWarning, match="cut there"):
        laid = pipeline_batch(batch, cfg, length)
    assert laid.image_mask[0].sum() == t + 1 and laid.image_mask[0, -1]
    assert (laid.labels[laid.loss_mask == 0] == IGNORE_INDEX).all()
    stage = _stages(model, cfg, 1)[0]
    args, kwargs = LlavaObjective(cfg, length).stage_inputs(laid, first=True, last=True)
    hidden = stage.embed_rows(args[0], kwargs["image_mask"], kwargs["images"], kwargs["image_counts"],
                              kwargs["position_ids"])
    features = model.image_features(batch.pixel_values)
    assert torch.equal(hidden[0, 1:1 + t], features[0])  # row 0's first image
    assert torch.equal(hidden[0, -1], features[1, 0])  # what is left of row 0's second image
    assert torch.equal(hidden[1, :t], features[2])  # row 1's own image


def test_the_length_rounds_up_for_sequence_parallelism_and_padding_positions_stay_in_the_table():
    from megatrain.models.llava.stage import pipeline_length

    cfg = llava_config("gpt2")  # learned positions, a table of 64
    t = cfg.tokens_per_image
    assert pipeline_length(cfg, 10) == 9 + t and pipeline_length(cfg, 10, 4) == -(-(9 + t) // 4) * 4
    batch = _batch(cfg, [[5, IMAGE, 7, 8]], [1], width=8)
    laid = pipeline_batch(batch, cfg, 66)
    assert laid.position_ids[0, :64].tolist() == list(range(64)) and laid.position_ids[0, 64:].tolist() == [63, 63]
