"""The LLaVA family (vision-language): a CLIP-style ViT vision encoder, a projector, and a GPT-family
language model (GPT-2 or LLaMA style) reading the text with the projected image features in place
of its image placeholder tokens. See docs/models/llava.md."""

from megatrain.models.llava.config import LlavaConfig, VisionConfig
from megatrain.models.llava.model import LlavaModel, initial_value
from megatrain.models.llava.projector import MultimodalProjector
from megatrain.models.llava.tokens import IGNORE_INDEX, ImageTokens, answer_loss_mask, expand_image_tokens
from megatrain.models.llava.vision import VisionEncoder

__all__ = ["LlavaConfig", "VisionConfig", "LlavaModel", "initial_value", "MultimodalProjector", "VisionEncoder",
           "IGNORE_INDEX", "ImageTokens", "answer_loss_mask", "expand_image_tokens"]
