"""Data side: tokenizers, preprocessing, Megatron indexed datasets, GPT sample order and loaders."""
