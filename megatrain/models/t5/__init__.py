"""The T5 family: Megatron-LM's T5 (an encoder and a decoder sharing one embedding, cross-attention,
an output layer tied to the word embeddings), trained by ``pretrain_t5.py``."""

from megatrain.models.t5.config import T5Config
from megatrain.models.t5.model import T5Model, initial_value

__all__ = ["T5Config", "T5Model", "initial_value"]
