"""Conversion between megatrain checkpoints and other formats (Hugging Face)."""
