#!/usr/bin/env python
"""Supervised fine-tuning with Megatron-LM compatible flags (`torchrun ... finetune_gpt.py ...`)."""

from megatrain.training.finetune import main

if __name__ == "__main__":
    main()
