#!/usr/bin/env python
"""Convert a local Hugging Face GPT2LMHeadModel / LlamaForCausalLM folder to a megatrain checkpoint
(`python tools/convert_hf_to_checkpoint.py --hf-path DIR --save CKPT`)."""

from megatrain.convert.import_hf import main

if __name__ == "__main__":
    main()
