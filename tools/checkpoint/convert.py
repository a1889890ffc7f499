#!/usr/bin/env python
"""Convert checkpoints between Megatron-LM (torch_dist, legacy torch), megatrain and Hugging Face formats, with
Megatron-LM's command line (`python tools/checkpoint/convert.py --model-type GPT --loader mcore --saver megatrain
--load-dir IN --save-dir OUT`)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir)))

from megatrain.convert.megatron.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
