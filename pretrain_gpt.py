#!/usr/bin/env python
"""Pre-train a GPT model with Megatron-LM compatible flags (`torchrun ... pretrain_gpt.py ...`)."""

from megatrain.training.main import main

if __name__ == "__main__":
    main()
