#!/usr/bin/env python
"""Loss/perplexity on a preprocessed dataset or jsonl, and LAMBADA-style last-word accuracy
(`python tools/evaluate.py --load CKPT --data-path PREFIX | --jsonl FILE | --lambada FILE`)."""

from megatrain.inference.evaluate import main

if __name__ == "__main__":
    main()
