"""Text generation from trained models (KV cache, sampling)."""
