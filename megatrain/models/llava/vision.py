"""The LLaVA family's vision encoder: a CLIP-style ViT (Megatron's ``CLIPViTModel``, Hugging Face's
``CLIPVisionModel``) as plain PyTorch, built from the shared transformer layer.

Module paths (Megatron's names where it has them):

    conv1                 the patch embedding: Conv2d(channels, h, kernel = stride = patch_dim, no bias)
    class_token           [1, 1, h], first in the sequence (``add_class_token``)
    position_embeddings   one learned position per token (the class token's is 0)
    ln_pre                LayerNorm before the first layer (CLIP's ``pre_layrnorm``)
    layers["0"...]        pre-LN bidirectional transformer layers (models/common/transformer_layer.py):
                          input_layernorm, self_attention.{linear_qkv, linear_proj},
                          pre_mlp_layernorm, mlp.{linear_fc1, linear_fc2} (quick_gelu or GELU)
    ln_post               the final LayerNorm (``post_layernorm`` "pooled" or "all"; see VisionConfig)

Activations are batch-first: images [b, channels, img_h, img_w] -> hidden states [b, tokens, h], the
class token first, then the patches row by row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megatrain.models.common.init import canonical_parameter_name, megatron_initial_value, seeded_normal
from megatrain.models.common.mlp import MLP
from megatrain.models.common.norms import build_norm
from megatrain.models.common.transformer_layer import TransformerLayer
from megatrain.models.llava.config import VisionConfig

__all__ = ["VisionEncoder", "VisionLayer", "VisionMLP", "quick_gelu", "vision_initial_value"]


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """OpenAI CLIP's GELU approximation: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


class VisionMLP(MLP):
    """The shared MLP (fc1, activation, fc2) with CLIP's ``quick_gelu`` as a further activation."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__(config)
        self.activation = config.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "quick_gelu":
            return self.linear_fc2(quick_gelu(self.linear_fc1(x)))
        return super().forward(x)  # GELU, exact or tanh-approximated


class VisionLayer(TransformerLayer):
    """The shared pre-norm transformer layer, bidirectional, with the vision MLP."""

    def __init__(self, config: VisionConfig, layer_number: int) -> None:
        super().__init__(config, layer_number, causal=False)
        self.mlp = VisionMLP(config)


class VisionEncoder(nn.Module):
    """A CLIP ViT. ``forward(images)`` gives the last layer's hidden states (through ``ln_post`` when
    ``post_layernorm`` is "all"); ``hidden_states(images, num_layers)`` every intermediate one, as
    LLaVA picks its features from them; ``pooled(hidden)`` CLIP's pooled output (the class token's
    hidden state through ``ln_post``)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.conv1 = nn.Conv2d(config.num_channels, h, kernel_size=config.patch_dim, stride=config.patch_dim,
                               bias=False)
        self.class_token = nn.Parameter(torch.empty(1, 1, h)) if config.add_class_token else None
        self.position_embeddings = nn.Embedding(config.seq_length, h)
        self.ln_pre = build_norm(config)
        self.layers = nn.ModuleDict({str(i): VisionLayer(config, layer_number=i) for i in range(config.num_layers)})
        self.ln_post: nn.Module | None = build_norm(config) if config.post_layernorm != "none" else None
        if not self.conv1.weight.is_meta:
            self.init_weights(seed=0)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Images [b, channels, img_h, img_w] -> the first layer's input [b, tokens, h] (after ``ln_pre``)."""
        cfg = self.config
        expected = (cfg.num_channels, cfg.img_h, cfg.img_w)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(f"images must be [batch, {cfg.num_channels}, {cfg.img_h}, {cfg.img_w}] (--num-channels, "
                             f"--img-h, --img-w), got {list(images.shape)}")
        if images.is_floating_point() and images.dtype != self.conv1.weight.dtype:
            images = images.to(self.conv1.weight.dtype)
        patches = self.conv1(images).flatten(2).transpose(1, 2)  # [b, patches, h], row by row
        if self.class_token is not None:
            patches = torch.cat([self.class_token.expand(patches.shape[0], -1, -1).to(patches.dtype), patches], dim=1)
        return self.ln_pre(patches + self.position_embeddings.weight.to(patches.dtype))

    def hidden_states(self, images: torch.Tensor, num_layers: int | None = None) -> list[torch.Tensor]:
        """[the embeddings after ``ln_pre``, after layer 0, ..., after layer ``num_layers`` - 1]: Hugging
        Face's ``hidden_states`` (no ``ln_post``), running only the first ``num_layers`` layers (default all)."""
        num_layers = self.config.num_layers if num_layers is None else num_layers
        if not 0 <= num_layers <= len(self.layers):
            raise ValueError(f"num_layers must be between 0 and {len(self.layers)}, got {num_layers}")
        hidden = self.embed(images)
        states = [hidden]
        for layer in list(self.layers.values())[:num_layers]:
            hidden = layer(hidden)
            states.append(hidden)
        return states

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Images -> the last layer's hidden states [b, tokens, h] (through ``ln_post`` if "all")."""
        hidden = self.hidden_states(images)[-1]
        if self.config.post_layernorm == "all":
            assert self.ln_post is not None
            hidden = self.ln_post(hidden)
        return hidden

    def pooled(self, hidden: torch.Tensor) -> torch.Tensor:
        """CLIP's pooled output [b, h]: the class token's last hidden state through ``ln_post``."""
        if self.class_token is None or self.ln_post is None:
            raise ValueError("the pooled output needs the class token and ln_post (post_layernorm 'pooled')")
        return self.ln_post(hidden[:, 0])

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        for name, param in self.named_parameters():
            param.copy_(vision_initial_value(name, param.shape, self.config, seed))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


_STD_WEIGHTS = frozenset({"conv1", "position_embeddings", "linear_qkv", "linear_fc1"})
_NORMS = frozenset({"ln_pre", "ln_post"})


def vision_initial_value(name: str, shape: Sequence[int], config: VisionConfig, seed: int) -> torch.Tensor:
    """The initial value of a vision-encoder parameter (its name relative to the encoder, or with a
    prefix such as ``vision_model.``): the patch embedding, class token, positions, linear_qkv and
    linear_fc1 N(0, std); linear_proj and linear_fc2 N(0, std / sqrt(2 L)); norms 1 (bias 0);
    biases 0 (Megatron's rules, by module name)."""
    canonical = canonical_parameter_name(name)
    parts = canonical.split(".")
    if parts[-1] == "class_token":  # a parameter named for itself
        return seeded_normal(canonical, shape, config.init_method_std, seed)
    if len(parts) >= 2 and parts[-2] in _NORMS:  # as the layers' norms (zero-centred with layernorm-1p)
        ones = parts[-1] == "weight" and not config.apply_layernorm_1p
        return torch.ones(tuple(shape)) if ones else torch.zeros(tuple(shape))
    return megatron_initial_value(name, shape, config, seed, std_weights=_STD_WEIGHTS)
