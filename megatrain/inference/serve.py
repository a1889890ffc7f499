"""`tools/run_text_generation_server.py`: load a checkpoint and serve it (see megatrain.inference.server)."""

from __future__ import annotations

import argparse
import sys

from megatrain.convert.hf_start import resolve_load
from megatrain.data.tokenizers import add_tokenizer_args, build_tokenizer
from megatrain.errors import user_errors_exit
from megatrain.inference.loading import fill_tokenizer_args, load_model
from megatrain.inference.server import ServerLimits, TextGenerationService, make_server
from megatrain.inference.text_generation import model_dtype
from megatrain.training.builders import choose_device


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run_text_generation_server.py", allow_abbrev=False,
                                description="Serve a megatrain checkpoint: PUT /api and POST /v1/completions.")
    p.add_argument("--load", required=True,
                   help="checkpoint directory (a --save directory or one iter_ folder), or a Hugging Face model "
                        "folder (hf:DIR, or DIR holding config.json)")
    p.add_argument("--ckpt-step", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt accepted (default: the model's position limit, else 4096)")
    p.add_argument("--max-tokens-to-generate", type=int, default=1024)
    p.add_argument("--max-batch-size", type=int, default=16, help="most prompts in one request")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20)
    p.add_argument("--request-body-timeout", type=float, default=30.0,
                   help="seconds to wait for a request body to arrive in full before answering 408")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no per-request log lines")
    add_tokenizer_args(p)
    return p


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    for flag in ("max_tokens_to_generate", "max_batch_size", "max_request_bytes"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be positive")
    if not args.request_body_timeout > 0:
        raise SystemExit("error: --request-body-timeout must be a positive number of seconds")
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"error: --port must be in 0..65535, got {args.port}")
    resolve_load(args)  # a Hugging Face folder: its converted checkpoint
    model, meta = load_model(args.load, choose_device(args.device), args.ckpt_step)
    model.to(model_dtype(args))
    tokenizer = build_tokenizer(fill_tokenizer_args(args, meta))
    max_prompt = args.max_prompt_tokens or min(model.config.max_position_embeddings, 4096)
    limits = ServerLimits(max_prompt, args.max_tokens_to_generate, args.max_batch_size, args.max_request_bytes,
                          args.request_body_timeout)
    try:
        server = make_server(TextGenerationService(model, tokenizer, limits), args.host, args.port, quiet=args.quiet)
    except OSError as e:
        raise SystemExit(f"error: cannot listen on {args.host}:{args.port} ({e.strerror})")
    host, port = server.server_address[:2]
    print(f" serving on http://{host}:{port} (PUT /api, POST /v1/completions, GET /health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    sys.stdout.flush()
