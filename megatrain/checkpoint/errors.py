"""The checkpoint errors: `CheckpointError`, a checkpoint that cannot be used (the message names
the file and says why), and `CheckpointSaveError`, a save that could not be written.

Both are ``ValueError``s, so every command's ``main`` reports them as one ``error: ...`` line.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be used with the current flags (the message says why)."""


class CheckpointSaveError(CheckpointError):
    """A save that could not be written (the message names the directory and the system's reason)."""
