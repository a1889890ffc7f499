"""`CheckpointError`: a checkpoint that cannot be used (the message names the file and says why).

It is a ``ValueError``, so every command's ``main`` reports it as one ``error: ...`` line.
`megatrain.training.checkpointing` re-exports it.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be used with the current flags (the message says why)."""
