"""Where images go in the text: the image placeholder token expanded to each image's positions, the
labels and loss mask moved with it, and a loss mask that keeps the answer tokens only.

Two conventions for a text with images are accepted (decided per batch, by counting placeholders):

- compact: one placeholder per image (Megatron's and the original LLaVA code's); each is expanded to
  ``tokens_per_image`` placeholders here, every row right-padded to the longest;
- expanded: ``tokens_per_image`` placeholders per image already (Hugging Face's ``LlavaProcessor``
  writes them); the text is used as it is.

Images are numbered in reading order over the batch (row 0's first, ...), as Hugging Face's
``masked_scatter`` fills them. Labels follow megatrain's convention (``labels[i]`` is the target of
position ``i``, the next text token): a placeholder's label goes to the last of its image's positions
(the one that predicts the text after the image); the other image positions, and every position
whose target is a placeholder, get no target (``IGNORE_INDEX``, loss mask 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["IGNORE_INDEX", "ImageTokens", "expand_image_tokens", "answer_loss_mask"]

IGNORE_INDEX = -100  # the cross entropy's ignored label (the per-token loss is 0 there)


@dataclass
class ImageTokens:
    """A batch's text laid out for the language model: ``tokens_per_image`` positions per image."""

    tokens: torch.Tensor  # [b, S] token ids; every image position holds the placeholder id
    image_mask: torch.Tensor  # bool [b, S]: the image positions, in reading order
    lengths: torch.Tensor  # [b] real (unpadded) positions of each row
    labels: torch.Tensor | None = None  # [b, S], IGNORE_INDEX where there is nothing to predict
    loss_mask: torch.Tensor | None = None  # float [b, S]

    @classmethod
    def laid_out(cls, tokens: torch.Tensor, image_mask: torch.Tensor,
                 labels: torch.Tensor | None = None) -> ImageTokens:
        """Text whose image positions are expanded already (``image_mask`` [b, S]), every row S long."""
        lengths = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long, device=tokens.device)
        return cls(tokens=tokens, image_mask=image_mask, lengths=lengths, labels=labels)


def expand_image_tokens(tokens: torch.Tensor, num_images: int, *, image_token_id: int, tokens_per_image: int,
                        pad_token_id: int = 0, labels: torch.Tensor | None = None,
                        loss_mask: torch.Tensor | None = None) -> ImageTokens:
    """``tokens`` [b, s] with ``num_images`` images in compact or expanded form (see the module
    docstring) -> the expanded :class:`ImageTokens`; ``labels`` and ``loss_mask`` [b, s] move with
    their positions. ValueError when the placeholders match neither form."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, sequence], got {list(tokens.shape)}")
    b, s = tokens.shape
    is_image = tokens == image_token_id
    count = int(is_image.sum())
    if count == num_images * tokens_per_image:  # expanded already (or no images)
        repeats = torch.ones_like(tokens)
    elif count == num_images:  # compact: each placeholder becomes an image's positions
        repeats = torch.where(is_image, tokens_per_image, 1)
    else:
        raise ValueError(f"the text holds {count} image tokens (id {image_token_id}) for {num_images} images: "
                         f"expected one per image, or {tokens_per_image} per image (already expanded)")

    # ends[r, i]: the last position that text position i occupies once expanded (increasing along i)
    ends = repeats.cumsum(dim=1) - 1
    lengths = ends[:, -1] + 1 if s else torch.zeros(b, dtype=torch.long, device=tokens.device)
    length = int(lengths.max()) if b and s else 0
    positions = torch.arange(length, device=tokens.device).expand(b, length)
    # source[r, j]: the text position that expanded position j comes from (s: past the row's end)
    source = torch.searchsorted(ends.contiguous(), positions.contiguous())
    real = source < s
    source = source.clamp(max=max(s - 1, 0))
    expanded = tokens.gather(1, source).masked_fill(~real, pad_token_id)
    image_mask = (expanded == image_token_id) & real
    # the one expanded position that keeps a text position's label: its last
    keeps_label = real & (ends.gather(1, source) == positions)

    new_labels = new_mask = None
    if labels is not None:
        new_labels = labels.gather(1, source).masked_fill(~keeps_label, IGNORE_INDEX)
        new_labels = new_labels.masked_fill(new_labels == image_token_id, IGNORE_INDEX)
    if loss_mask is not None:
        new_mask = loss_mask.gather(1, source).masked_fill(~keeps_label, 0)
        if new_labels is not None:
            new_mask = new_mask.masked_fill(new_labels == IGNORE_INDEX, 0)
        else:  # no labels: the target of position j is the token at j + 1
            next_is_image = torch.zeros_like(image_mask)
            next_is_image[:, :-1] = image_mask[:, 1:]
            new_mask = new_mask.masked_fill(next_is_image, 0)
    return ImageTokens(tokens=expanded, image_mask=image_mask, lengths=lengths, labels=new_labels,
                       loss_mask=new_mask)


def answer_loss_mask(labels: torch.Tensor, answer_starts: torch.Tensor, *,
                     pad_token_id: int | None = None) -> torch.Tensor:
    """A loss mask [b, s] (float) that keeps the answer tokens only.

    A text sample is ``x[0 .. s]``, its tokens ``x[:-1]`` and labels ``x[1:]``; ``answer_starts[r]`` is
    the index in ``x`` of row r's first answer token, so label i (the token ``x[i + 1]``) counts when
    ``i + 1 >= answer_starts[r]``. Labels equal to ``pad_token_id`` (padding) do not count. Expanding
    the images (:func:`expand_image_tokens` with ``loss_mask=``) then keeps image positions out."""
    b, s = labels.shape
    target = torch.arange(1, s + 1, device=labels.device).expand(b, s)
    keep = target >= answer_starts.to(labels.device).view(b, 1)
    if pad_token_id is not None:
        keep &= labels != pad_token_id
    return keep.float()
