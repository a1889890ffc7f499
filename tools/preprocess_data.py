"""Tokenize jsonl/text into Megatron-LM .bin/.idx files (same flags as Megatron-LM's tool)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatrain.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    main()
