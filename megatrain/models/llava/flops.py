"""FLOPs of the LLaVA family, in the style of Megatron-LM's formula (:mod:`megatrain.models.common.flops`),
counting what autograd runs with the frozen parts (``--freeze-LM``, ``--freeze-ViT``,
``--freeze-vision-projection``): a matmul costs 2 per multiply-add forward, 2 more for its input's
gradient when its input needs one, 2 more for its weight's gradient when the weight trains (6 for a
trained layer inside a trained network); norms, activations and softmax are not counted.

Per image, with P patches, T = P + class token the encoder's tokens, h the vision hidden size, c the
channels, p the patch size, L_run the encoder layers that run (up to the deepest feature layer),
n heads, g query groups, d head dim, F the encoder's MLP width, and the projector's input width
h_in, inner width F_p and output width H (the language model's hidden size), T_img its tokens:

    patch embedding   (2 + 2 w_v) * P * (c p^2) * h          (its input, the image, needs no gradient)
    encoder layers    k_v * T * L_run * [h d (n + 2g) + d n h + 2 h F]  +  2 k_v * T^2 * L_run * n d
    projector         mlp: k(w_v, w_p) * T_img * h_in F_p + k(w_v or w_p, w_p) * T_img * F_p H
                      affine: k(w_v, w_p) * T_img * h_in H

with w_v / w_p whether the encoder / projector train, k_v = 6 if the encoder trains else 2 (forward
only: nothing before it needs a gradient), k(input, weight) = 2 + 2 input + 2 weight. The encoder's
attention is bidirectional: QK^T and attention x V over the whole T x T matrix. The language model
is the GPT formula; frozen, its weight matmuls lose their weight gradients (4 of 6) while its
attention term stays whole (the image features before it still need gradients).

The log line counts what each iteration ran (:func:`batch_flops`, the family's ``batch_flops``): per
micro-batch as the loader gives it (on the host, so no device sync), its ``b`` rows at the length S the
language model runs them (the padded text with each placeholder expanded to ``tokens_per_image``
positions: ``s + max_r(k_r) (T_img - 1)`` for rows of ``k_r`` images in the compact form, ``s`` when the
text holds the expanded runs already, the ``segments`` width of packed rows, the pipeline's fixed
``seq_length - 1 + T_img`` under pipeline parallelism) and its ``N = sum_r k_r`` images through the
encoder and projector:

    language_flops(b, S) + vision_flops(N) + projector_flops(N)

Packed rows are counted as one sequence of S positions (their attention over the whole row, as the
GPT formula counts a row).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from megatrain.models.common.flops import transformer_flops
from megatrain.models.llava.config import LlavaConfig

__all__ = ["vision_flops", "projector_flops", "language_flops", "num_floating_point_operations",
           "expanded_length", "batch_flops", "batch_flops_counter"]


def _matmul(input_grad: bool, weight_grad: bool) -> int:
    """FLOPs per multiply-add of one matmul, forward and the backward autograd runs."""
    return 2 + 2 * input_grad + 2 * weight_grad


def vision_flops(cfg: LlavaConfig, num_images: int) -> float:
    """FLOPs of the vision encoder over ``num_images`` images (the layers that run): forward and, when
    it trains, backward."""
    v = cfg.vision
    assert v.kv_channels is not None and v.num_query_groups is not None and v.ffn_hidden_size is not None
    h, n, g, d, F = v.hidden_size, v.num_attention_heads, v.num_query_groups, v.kv_channels, v.ffn_hidden_size
    P, T, L = v.num_patches, v.seq_length, cfg.vision_layers_run
    trained = not cfg.freeze_vision_model
    k = _matmul(trained, trained)
    patch_embedding = _matmul(False, trained) * P * v.num_channels * v.patch_dim**2 * h
    layers = k * T * L * (h * d * (n + 2 * g) + d * n * h + 2 * h * F) + 2 * k * T * T * L * n * d
    return float(num_images * (patch_embedding + layers))


def projector_flops(cfg: LlavaConfig, num_images: int) -> float:
    """FLOPs of the projector over ``num_images`` images: forward and the backward autograd runs."""
    h_in, H, T = cfg.projector_input_size, cfg.language.hidden_size, cfg.tokens_per_image
    vision, projector = not cfg.freeze_vision_model, not cfg.freeze_projector
    if cfg.projector_type == "mlp":
        ffn = cfg.projector_ffn_hidden_size
        assert ffn is not None
        cost = _matmul(vision, projector) * h_in * ffn + _matmul(vision or projector, projector) * ffn * H
    else:
        cost = _matmul(vision, projector) * h_in * H
    return float(num_images * T * cost)


def language_flops(cfg: LlavaConfig, batch_size: int, seq_length: int) -> float:
    """The language model's GPT formula; frozen, without its weight gradients (attention stays whole)."""
    total = transformer_flops(cfg.language, batch_size, seq_length)
    if not cfg.freeze_language_model:
        return total
    lm = cfg.language
    attention = 6.0 * batch_size * seq_length * seq_length * lm.num_layers * lm.num_attention_heads * lm.kv_channels
    return (total - attention) * 4 / 6 + attention


def num_floating_point_operations(cfg: LlavaConfig, batch_size: int, seq_length: int,
                                  images_per_sample: int = 1, *, num_images: int | None = None) -> float:
    """Model FLOPs of one iteration: ``batch_size`` sequences of ``seq_length`` positions (images
    expanded) through the language model, and their images (``num_images``, default ``batch_size *
    images_per_sample``) through the encoder and projector, as the frozen parts run them."""
    images = batch_size * images_per_sample if num_images is None else int(num_images)
    return language_flops(cfg, batch_size, seq_length) + vision_flops(cfg, images) + projector_flops(cfg, images)


def expanded_length(cfg: LlavaConfig, tokens: Any, image_counts: Any) -> int:
    """The positions per row the language model runs for text ``tokens`` [b, s] with ``image_counts``
    [b] images per row, as :func:`megatrain.models.llava.tokens.expand_image_tokens` lays them out: ``s``
    when the text holds ``tokens_per_image`` ids per image already (or has no images), else ``s`` plus
    the most placeholders of a row times ``tokens_per_image - 1``."""
    s = int(tokens.shape[1])
    images = int(image_counts.sum())
    per_image = cfg.tokens_per_image
    if images == 0 or per_image == 1:
        return s
    placeholders = tokens == cfg.image_token_id
    count = int(placeholders.sum())
    if count == images * per_image:  # expanded already
        return s
    per_row = placeholders.sum(dim=1) if count == images else image_counts
    return s + int(per_row.max()) * (per_image - 1)


def batch_flops(cfg: LlavaConfig, batch: Any, length: int | None = None) -> float:
    """Model FLOPs of one micro-batch as the loader gives it (a
    :class:`megatrain.data.multimodal.MultimodalBatch` on the host): its rows at the length the language
    model runs them (``length`` where it is fixed), its images through the encoder and projector
    (module docstring)."""
    tokens, counts = batch.tokens, batch.image_counts
    if length is None:
        segments = getattr(batch, "segments", None)
        length = int(segments.shape[1]) if segments is not None else expanded_length(cfg, tokens, counts)
    return num_floating_point_operations(cfg, int(tokens.shape[0]), length, num_images=int(counts.sum()))


def batch_flops_counter(args: Any, cfg: LlavaConfig) -> Callable[[Any], float]:
    """The family's ``batch_flops``: :func:`batch_flops` for the run of ``args``, the rows at the
    pipeline's fixed length (``seq_length - 1 + tokens_per_image``) under pipeline parallelism."""
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        from megatrain.models.llava.stage import pipeline_length

        return functools.partial(batch_flops, cfg, length=pipeline_length(cfg, args.seq_length))
    return functools.partial(batch_flops, cfg)
