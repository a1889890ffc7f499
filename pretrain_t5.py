#!/usr/bin/env python
"""Pre-train a T5 model with Megatron-LM compatible flags (`torchrun ... pretrain_t5.py ...`)."""

from megatrain.training.main import main_t5

if __name__ == "__main__":
    main_t5()
