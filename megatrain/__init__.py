"""megatrain: Megatron-LM compatible LLM training on a PyTorch-native engine."""

import time as _time

# The earliest moment megatrain's code runs in this process (before torch is imported): Megatron-LM's
# _TRAIN_START_TIME, from which "time to initialize megatron" is counted.
START_TIME = _time.time()

__version__ = "0.1.0"
