#!/usr/bin/env python
"""Export a megatrain checkpoint as a Hugging Face model folder
(`python tools/convert_checkpoint_to_hf.py --checkpoint-path CKPT --output-path DIR [--dtype bf16]`)."""

from megatrain.convert.export_hf import main

if __name__ == "__main__":
    main()
