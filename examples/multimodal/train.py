#!/usr/bin/env python
"""Megatron-LM's ``examples/multimodal/train.py`` entry point: the same as ``pretrain_vlm.py`` (the
LLaVA family; ``torchrun ... examples/multimodal/train.py ...`` as Megatron's
``pretrain_mistral_clip.sh`` launches it). See docs/models/llava.md."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir)))

from megatrain.training.main import main_vlm  # noqa: E402

if __name__ == "__main__":
    main_vlm()
