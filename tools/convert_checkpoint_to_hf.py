#!/usr/bin/env python
"""Export a megatrain checkpoint as a Hugging Face model folder
(`python tools/convert_checkpoint_to_hf.py --checkpoint-path CKPT --output-path DIR [--dtype bf16]`)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatrain.convert.export_hf import main  # noqa: E402

if __name__ == "__main__":
    main()
