"""The GPT family: decoder-only transformers, GPT-2 style by default and LLaMA style by flags
(RoPE, RMSNorm, SwiGLU, grouped-query attention, untied output layer)."""

from megatrain.models.common.attention import KVCache
from megatrain.models.common.embedding import Embedding
from megatrain.models.common.init import canonical_parameter_name
from megatrain.models.common.transformer_layer import TransformerLayer
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt.model import GPTModel, initial_value

__all__ = ["GPTConfig", "GPTModel", "TransformerLayer", "Embedding", "KVCache", "initial_value",
           "canonical_parameter_name"]
