"""Blocks every model family shares: attention, MLP, norms, rotary and token embeddings, the
transformer layer, initialisation rules and the typed transformer shape."""
