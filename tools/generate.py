#!/usr/bin/env python
"""Generate text from a megatrain checkpoint (`python tools/generate.py --load CKPT --prompt ...`)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatrain.inference.text_generation import main  # noqa: E402

if __name__ == "__main__":
    main()
