#!/usr/bin/env python
"""Serve a megatrain checkpoint over HTTP: Megatron-LM's `PUT /api`, OpenAI's `POST /v1/completions` and
`POST /v1/chat/completions` (`python tools/run_text_generation_server.py --load CKPT --port 5000`; with
tensor parallelism `torchrun --nproc_per_node N ... --tensor-model-parallel-size N`)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatrain.inference.serve import main  # noqa: E402

if __name__ == "__main__":
    main()
