#!/usr/bin/env python
"""Pre-train a BERT model with Megatron-LM compatible flags (`torchrun ... pretrain_bert.py ...`)."""

from megatrain.training.main import main_bert

if __name__ == "__main__":
    main_bert()
