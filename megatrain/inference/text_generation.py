"""`tools/generate.py` / `megatrain generate`: complete prompts with a trained checkpoint."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from megatrain.data.tokenizers import add_tokenizer_args, build_tokenizer
from megatrain.errors import user_errors_exit
from megatrain.inference.generation import generate
from megatrain.inference.loading import fill_tokenizer_args, load_model
from megatrain.training.builders import choose_device


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="generate.py", allow_abbrev=False,
                                description="Generate text from a megatrain checkpoint.")
    p.add_argument("--load", required=True, help="checkpoint directory (a --save directory or one iter_ folder)")
    p.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--input-file", default=None, help='jsonl file of {"prompt": ...} objects')
    p.add_argument("--tokens-to-generate", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="take the most likely token (default: sample)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop when this text is generated (repeatable)")
    p.add_argument("--output-json", default=None, help='write [{"prompt", "text", "tokens"}, ...] here')
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    add_tokenizer_args(p)
    return p


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.input_file:
        with open(args.input_file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    prompts.append(obj["prompt"] if isinstance(obj, dict) else str(obj))
                except (json.JSONDecodeError, KeyError) as e:
                    raise SystemExit(f"error: --input-file {args.input_file}:{lineno}: expected a JSON object "
                                     f'with a "prompt" key ({e})')
    if not prompts:
        raise SystemExit("error: give at least one --prompt or an --input-file")
    return prompts


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.tokens_to_generate < 0:
        raise SystemExit("error: --tokens-to-generate must be >= 0")
    prompts = read_prompts(args)
    device = choose_device(args.device)
    model, meta = load_model(args.load, device, args.ckpt_step)
    tokenizer = build_tokenizer(fill_tokenizer_args(args, meta))
    prompt_ids = [tokenizer.tokenize(p) for p in prompts]
    stop_seqs = [tokenizer.tokenize(s) for s in args.stop] or None
    with torch.no_grad():
        out = generate(model, prompt_ids, args.tokens_to_generate, greedy=args.greedy,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eod=tokenizer.eod,
                       stop_token_sequences=stop_seqs, seed=args.seed)
    results = []
    for prompt, ids in zip(prompts, out):
        text = tokenizer.detokenize(ids)
        for s in args.stop:
            if s in text:
                text = text[: text.index(s)]
        results.append({"prompt": prompt, "text": text, "tokens": ids})
        print(f"--- prompt: {prompt!r}\n{prompt}{text}\n", flush=True)
    if args.output_json:
        tmp = args.output_json + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, args.output_json)
    sys.stdout.flush()
