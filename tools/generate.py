#!/usr/bin/env python
"""Generate text from a megatrain checkpoint (`python tools/generate.py --load CKPT --prompt ...`)."""

from megatrain.inference.text_generation import main

if __name__ == "__main__":
    main()
