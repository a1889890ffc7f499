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
"""

from __future__ import annotations

from megatrain.models.common.flops import transformer_flops
from megatrain.models.llava.config import LlavaConfig

__all__ = ["vision_flops", "projector_flops", "language_flops", "num_floating_point_operations"]


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
                                  images_per_sample: int = 1) -> float:
    """Model FLOPs of one iteration: ``batch_size`` sequences of ``seq_length`` positions (images
    expanded) through the language model, and their images through the encoder and projector, as
    the frozen parts run them."""
    images = batch_size * images_per_sample
    return language_flops(cfg, batch_size, seq_length) + vision_flops(cfg, images) + projector_flops(cfg, images)
