#!/usr/bin/env python
"""Loss/perplexity on a preprocessed dataset or jsonl, and LAMBADA-style last-word accuracy
(`python tools/evaluate.py --load CKPT --data-path PREFIX | --jsonl FILE | --lambada FILE`)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatrain.inference.evaluate import main  # noqa: E402

if __name__ == "__main__":
    main()
