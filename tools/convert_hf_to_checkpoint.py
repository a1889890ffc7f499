#!/usr/bin/env python
"""Convert a local Hugging Face GPT2LMHeadModel / LlamaForCausalLM folder to a megatrain checkpoint
(`python tools/convert_hf_to_checkpoint.py --hf-path DIR --save CKPT`)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatrain.convert.import_hf import main  # noqa: E402

if __name__ == "__main__":
    main()
