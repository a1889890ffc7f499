"""megatrain: Megatron-LM compatible LLM training on a PyTorch-native engine."""

__version__ = "0.1.0"
