"""Plain single-device PyTorch model definitions (no process groups in here)."""
