#!/usr/bin/env python
"""Fine-tune a checkpoint on a downstream task with Megatron-LM compatible flags (`torchrun ... finetune.py ...`):
sequence classification for a BERT checkpoint, supervised fine-tuning (finetune_gpt.py) for a GPT one,
input/target sequence-to-sequence fine-tuning for a T5 one."""

from megatrain.training.finetune_classify import main_any

if __name__ == "__main__":
    main_any()
