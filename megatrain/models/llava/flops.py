"""FLOPs of the LLaVA family, in the style of Megatron-LM's formula (:mod:`megatrain.models.common.flops`):
every matmul costs 2*m*k*n forward and twice that backward, hence 6 per multiply-add of one
forward+backward pass; norms, activations and softmax are not counted.

Per image, with P patches, T = P + class token the encoder's tokens, h the vision hidden size, c the
channels, p the patch size, L_run the encoder layers that run (up to the deepest feature layer),
n heads, g query groups, d head dim, F the encoder's MLP width, and the projector's input width
h_in, inner width F_p and output width H (the language model's hidden size), T_img its tokens:

    patch embedding   6 * P * (c p^2) * h
    encoder layers    6 * T * L_run * [h d (n + 2g) + d n h + 2 h F]  +  12 * T^2 * L_run * n d
    projector         mlp: 6 * T_img * (h_in F_p + F_p H);  affine: 6 * T_img * h_in H

The encoder's attention is bidirectional: its QK^T and attention x V are counted over the whole
T x T score matrix (12, not the causal 6 of the language model's term). A frozen encoder (no weight
gradients) costs less; this counts it as trained, as Megatron's log line does for its models.
"""

from __future__ import annotations

from megatrain.models.common.flops import transformer_flops
from megatrain.models.llava.config import LlavaConfig

__all__ = ["vision_flops", "projector_flops", "num_floating_point_operations"]


def vision_flops(cfg: LlavaConfig, num_images: int) -> float:
    """FLOPs of the vision encoder's forward+backward over ``num_images`` images (the layers that run)."""
    v = cfg.vision
    assert v.kv_channels is not None and v.num_query_groups is not None and v.ffn_hidden_size is not None
    h, n, g, d, F = v.hidden_size, v.num_attention_heads, v.num_query_groups, v.kv_channels, v.ffn_hidden_size
    P, T, L = v.num_patches, v.seq_length, cfg.vision_layers_run
    patch_embedding = 6 * P * v.num_channels * v.patch_dim**2 * h
    layers = 6 * T * L * (h * d * (n + 2 * g) + d * n * h + 2 * h * F) + 12 * T * T * L * n * d
    return float(num_images * (patch_embedding + layers))


def projector_flops(cfg: LlavaConfig, num_images: int) -> float:
    """FLOPs of the projector's forward+backward over ``num_images`` images."""
    h_in, H, T = cfg.projector_input_size, cfg.language.hidden_size, cfg.tokens_per_image
    if cfg.projector_type == "mlp":
        ffn = cfg.projector_ffn_hidden_size
        assert ffn is not None
        per_token = h_in * ffn + ffn * H
    else:
        per_token = h_in * H
    return float(num_images * 6 * T * per_token)


def num_floating_point_operations(cfg: LlavaConfig, batch_size: int, seq_length: int,
                                  images_per_sample: int = 1) -> float:
    """Model FLOPs of one iteration: ``batch_size`` sequences of ``seq_length`` positions (images
    expanded) through the language model (the GPT formula), and their images through the encoder
    and projector."""
    images = batch_size * images_per_sample
    return transformer_flops(cfg.language, batch_size, seq_length) + vision_flops(cfg, images) + projector_flops(
        cfg, images)
