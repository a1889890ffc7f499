"""Parallelism applied from outside to the unchanged models: device mesh, TP/SP, DP/FSDP, PP."""
