"""The generation engine: continuous batching over a fixed-memory KV cache (see ``api`` for its contract)."""
