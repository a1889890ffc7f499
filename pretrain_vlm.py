#!/usr/bin/env python
"""Train a LLaVA-style vision-language model with Megatron-LM compatible flags
(`torchrun ... pretrain_vlm.py --freeze-LM --freeze-ViT ...`; see docs/models/llava.md)."""

from megatrain.training.main import main_vlm

if __name__ == "__main__":
    main_vlm()
