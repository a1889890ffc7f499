#!/usr/bin/env python
"""Predict the tokens at each [MASK] with a BERT checkpoint (`python tools/fill_mask.py --load CKPT --text ...`)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatrain.inference.fill_mask import main  # noqa: E402

if __name__ == "__main__":
    main()
