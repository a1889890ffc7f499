"""The BERT family: Megatron-LM's BERT (bidirectional encoder, masked-LM head tied to the word
embeddings, pooler and sentence-order head), trained by ``pretrain_bert.py``."""

from megatrain.models.bert.config import BertConfig
from megatrain.models.bert.model import BertModel, initial_value

__all__ = ["BertConfig", "BertModel", "initial_value"]
