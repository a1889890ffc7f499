"""Checkpoint file safety: what may be read from a checkpoint and how its files are verified.

`megatrain.training.checkpointing` owns the directory layout, saving and loading; the modules
here own the pieces it trusts nothing without: the restricted readers of the files a checkpoint
holds and the integrity checks of its shards.
"""
