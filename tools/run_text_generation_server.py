#!/usr/bin/env python
"""Serve a megatrain checkpoint over HTTP: Megatron-LM's `PUT /api` and OpenAI-style `POST /v1/completions`
(`python tools/run_text_generation_server.py --load CKPT --port 5000`)."""

from megatrain.inference.serve import main

if __name__ == "__main__":
    main()
