"""LLaVA's micro-batches are laid out on the host (LlavaObjective.host_batch, before they move to the
device): the expanded text, image mask and labels; the model run on that layout gives the losses and
gradients of the model expanding the text itself, for rows with no, one and two images; a layout is
not laid out twice; the laid-out batch pins (a DataLoader with pin_memory=True) and moves as a whole."""

from __future__ import annotations

import pytest
import torch

from megatrain.data.batch import Batch
from megatrain.models.llava import IGNORE_INDEX
from megatrain.models.llava.objective import LlavaLaidOutBatch, LlavaObjective
from tests.unit.test_llava_model import IMAGE, llava_config, model_of
from tests.unit.test_llava_pipeline_stage import _batch

ROWS = [[5, IMAGE, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [IMAGE, 5, 6, IMAGE, 7, 8, 9]]
COUNTS = [1, 0, 2]


def test_the_host_layout_trains_as_the_model_expanding_the_text():
    cfg = llava_config("llava")
    batch = _batch(cfg, ROWS, COUNTS, width=10)
    objective = LlavaObjective(cfg)
    laid = objective.host_batch(batch)
    assert isinstance(laid, LlavaLaidOutBatch) and objective.make_batch(laid) is laid
    t = cfg.tokens_per_image
    assert laid.tokens.shape == (3, 10 + 2 * (t - 1))  # the padded rows, the widest with two images expanded
    assert laid.image_mask.sum() == 3 * t and (laid.tokens[laid.image_mask] == IMAGE).all()
    # the labels the mask keeps are all there, in order
    kept = batch.labels[batch.loss_mask > 0]
    assert torch.equal(laid.labels[laid.labels != IGNORE_INDEX], kept)

    def run(model, call):
        model.zero_grad()
        out = call(model)
        out.sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model = model_of(cfg)
    labels = batch.labels.masked_fill(batch.loss_mask == 0, IGNORE_INDEX)
    ref, ref_grads = run(model, lambda m: m(batch.tokens, batch.pixel_values, labels=labels))
    out, grads = run(model, lambda m: objective.forward(m, laid))
    assert torch.equal(out, ref)
    assert ref_grads.keys() == grads.keys() and any(n.startswith("projector.") for n in grads)
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name
    # the count of the loss is the text's own answer mask
    (_, count), = objective.losses(out, objective.loss_target(laid))
    assert float(count) == float(batch.loss_mask.sum())


def test_a_placeholder_count_that_fits_no_image_count_is_refused_on_the_host():
    cfg = llava_config("llava")
    batch = _batch(cfg, ROWS, COUNTS, width=10)
    broken = Batch.cat.__func__(type(batch), [batch])  # a copy
    broken.pixel_values = broken.pixel_values[:2]  # three placeholders, two images
    with pytest.raises(ValueError, match="3 image tokens .* for 2 images"):
        LlavaObjective(cfg).host_batch(broken)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_loader_pins_typed_batches():
    from torch.utils.data import DataLoader

    cfg = llava_config("llava")
    batch = _batch(cfg, ROWS, COUNTS, width=10)
    loader = DataLoader([0], batch_size=1, collate_fn=lambda _: batch, pin_memory=True)
    pinned = next(iter(loader))
    assert pinned.tokens.is_pinned() and pinned.pixel_values.is_pinned()
    moved = LlavaObjective(cfg).host_batch(pinned).to(torch.device("cuda"), non_blocking=True)
    assert moved.pixel_values.is_cuda and torch.equal(moved.pixel_values.cpu(), batch.pixel_values)
