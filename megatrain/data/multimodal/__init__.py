"""Data for LLaVA-style vision-language training: CLIP image preprocessing, LLaVA's jsonl
conversations with images, batches that mix text-only and image samples, and megatron-energon
webdataset shards read into the same samples (see docs/multimodal.md).

Modules: ``image_processing`` (CLIP's resize / crop / normalize in torch + PIL), ``conversation``
(``<image>`` placeholders and answer-only targets through megatrain's SFT tokenization),
``llava_dataset`` (the jsonl dataset: seeded per-epoch order, bad images named or skipped),
``collate`` (``MultimodalBatch``), ``energon`` (optional: ``pip install megatrain[multimodal]``),
``errors`` (``MultimodalDataError``).
"""

from megatrain.data.multimodal.collate import MultimodalBatch, MultimodalCollator
from megatrain.data.multimodal.conversation import IMAGE_PLACEHOLDER, ConversationEncoder, to_messages
from megatrain.data.multimodal.errors import MultimodalDataError
from megatrain.data.multimodal.image_processing import CLIPImageConfig, CLIPImageProcessor
from megatrain.data.multimodal.llava_dataset import LlavaJsonlDataset, load_image

__all__ = ["CLIPImageConfig", "CLIPImageProcessor", "ConversationEncoder", "IMAGE_PLACEHOLDER", "LlavaJsonlDataset",
           "MultimodalBatch", "MultimodalCollator", "MultimodalDataError", "load_image", "to_messages"]
