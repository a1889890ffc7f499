"""`tools/generate.py` / `megatrain generate`: complete prompts with a trained checkpoint.

`complete()` is the text-in, text-out layer shared with the server and the evaluation tool: it
tokenizes, runs :func:`generate` over micro-batches of prompts, turns stop strings into both early
stopping (token sequences) and a cut of the decoded text, and reports why each completion ended.
An encoder-decoder checkpoint (T5) takes the prompts as encoder inputs and completes them with the
decoder (:mod:`megatrain.inference.seq2seq`). A vision-language (LLaVA) checkpoint takes ``--image``
files (:mod:`megatrain.inference.vision`).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatrain.atomic_io import atomic_write_json
from megatrain.convert.hf_start import resolve_load
from megatrain.data.jsonl import iter_jsonl
from megatrain.data.tokenizers import add_tokenizer_args, build_tokenizer
from megatrain.errors import user_errors_exit
from megatrain.inference.fill_mask import masked_lm_hint
from megatrain.inference.generation import generate
from megatrain.inference.loading import fill_tokenizer_args, load_model
from megatrain.inference.seq2seq import (decoder_start_token, end_token, generate_seq2seq, is_encoder_decoder,
                                         tokenize_with_sentinels)
from megatrain.parallel.distributed import destroy_distributed, init_distributed
from megatrain.training.builders import choose_device
from megatrain.flags import OneLineArgumentParser


@dataclass
class SamplingParams:
    """How to choose tokens: greedy, or sampling with temperature / top-k / top-p and a seed."""

    tokens_to_generate: int = 64
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_on_eod: bool = True


@dataclass
class Completion:
    prompt: str
    text: str  # generated text only, cut before the first stop string
    tokens: list[int]  # generated ids (stop tokens included, as generated)
    prompt_tokens: list[int]
    finish_reason: str  # "stop" (EOD or a stop string) or "length"


def end_ids(tokenizer: Any) -> list[int]:
    """The ids that end a generation: the tokenizer's eod, and a Hugging Face folder's other eos ids
    (generation_config.json)."""
    ids = getattr(tokenizer, "end_ids", None)
    return list(ids) if ids is not None else ([tokenizer.eod] if tokenizer.eod is not None else [])


def complete(model: nn.Module, tokenizer, prompts: list[str], params: SamplingParams,
             micro_batch_size: int | None = None, prompt_ids: list[list[int]] | None = None,
             on_tokens: Callable[[int, list[int | None]], None] | None = None) -> list[Completion]:
    """Complete every prompt; ``micro_batch_size`` prompts go through the model at once (all by default).

    With a seed, sampling is reproducible for the same prompts and micro-batch size.
    ``on_tokens(first, tokens)`` is called after every decoding step of the micro-batch whose
    first prompt is number ``first``, with each of its prompts' new token (None once stopped).
    """
    seq2seq = is_encoder_decoder(model)  # T5: the prompts are encoder inputs, the completions decoder outputs
    if prompt_ids is None:
        prompt_ids = [tokenize_with_sentinels(tokenizer, p) if seq2seq else tokenizer.tokenize(p) for p in prompts]
    stop_seqs = [ids for ids in (tokenizer.tokenize(s) for s in params.stop) if ids]
    ends = (([end_token(tokenizer)] if seq2seq else end_ids(tokenizer)) if params.stop_on_eod else [])
    ends = [e for e in ends if e is not None]
    eod = ends[0] if ends else None
    stop_seqs = [*stop_seqs, *([e] for e in ends[1:])] or None  # a chat model's other end ids
    size = micro_batch_size or len(prompts) or 1
    out: list[Completion] = []
    for start in range(0, len(prompts), size):
        chunk = prompt_ids[start:start + size]
        if params.tokens_to_generate == 0:
            generated: list[list[int]] = [[] for _ in chunk]
        else:
            seed = None if params.seed is None else params.seed + start
            sampling = dict(greedy=params.greedy, temperature=params.temperature, top_k=params.top_k,
                            top_p=params.top_p, eod=eod, stop_token_sequences=stop_seqs, seed=seed,
                            on_tokens=None if on_tokens is None else partial(on_tokens, start))
            with torch.no_grad():
                if seq2seq:
                    generated = generate_seq2seq(model, chunk, params.tokens_to_generate,
                                                 decoder_start=decoder_start_token(tokenizer),
                                                 vocab_size=tokenizer.vocab_size, **sampling)
                else:
                    generated = generate(model, chunk, params.tokens_to_generate, **sampling)
        for prompt, ids, new in zip(prompts[start:start + size], chunk, generated):
            text = tokenizer.detokenize(new) if new else ""
            reason = "length"
            if new and new[-1] in ends:
                reason = "stop"
                text = tokenizer.detokenize(new[:-1]) if len(new) > 1 else ""
            cuts = [text.index(s) for s in params.stop if s and s in text]
            if cuts:
                text = text[: min(cuts)]
                reason = "stop"
            out.append(Completion(prompt, text, new, list(ids), reason))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="generate.py", allow_abbrev=False,
                                description="Generate text from a megatrain checkpoint.")
    p.add_argument("--load", required=True,
                   help="checkpoint directory (a --save directory or one iter_ folder), or a Hugging Face model "
                        "folder (hf:DIR, or DIR holding config.json)")
    p.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--input-file", default=None, help='jsonl file of {"prompt": ...} objects')
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for every prompt (a LLaVA checkpoint; repeatable for several images per prompt): "
                        "the prompt's <image> placeholders take them in order, a prompt without one gets them "
                        "before its text")
    p.add_argument("--tokens-to-generate", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="take the most likely token (default: sample)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop when this text is generated (repeatable)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="prompts generated together (default: all at once)")
    p.add_argument("--output-json", default=None, help='write [{"prompt", "text", "tokens"}, ...] here')
    p.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="generate with the model split over this many processes (launch with torchrun)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--bf16", action="store_true", help="run the model in bfloat16")
    p.add_argument("--fp16", action="store_true", help="run the model in float16")
    add_tokenizer_args(p)
    return p


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.input_file:
        for lineno, obj in iter_jsonl(args.input_file, "--input-file"):
            prompt = obj.get("prompt") if isinstance(obj, dict) else obj
            if not isinstance(prompt, str):
                raise ValueError(f"--input-file {args.input_file}:{lineno}: expected a JSON object with a "
                                 f'string "prompt" (or a JSON string)')
            prompts.append(prompt)
    if not prompts:
        raise SystemExit("error: give at least one --prompt or an --input-file")
    return prompts


def model_dtype(args: argparse.Namespace) -> torch.dtype:
    if getattr(args, "bf16", False) and getattr(args, "fp16", False):
        raise SystemExit("error: --bf16 and --fp16 cannot be used together")
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.float32


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.tokens_to_generate < 0:
        raise SystemExit("error: --tokens-to-generate must be >= 0")
    if args.micro_batch_size is not None and args.micro_batch_size <= 0:
        raise SystemExit("error: --micro-batch-size must be positive")
    prompts = read_prompts(args)
    resolve_load(args, args.tensor_model_parallel_size)  # a Hugging Face folder: its converted checkpoint
    hint = masked_lm_hint(args.load, args.ckpt_step)  # a BERT checkpoint: fill-mask, not generation
    if hint:
        raise SystemExit(f"error: {hint}")
    device = choose_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    tp_mesh = tensor_parallel_mesh(args, device)
    try:
        _generate_all(args, prompts, device, tp_mesh)
    finally:
        del tp_mesh  # the mesh and model must be unreachable before the process groups go
        destroy_distributed()


def _generate_all(args: argparse.Namespace, prompts: list[str], device: torch.device,
                  tp_mesh: DeviceMesh | None) -> None:
    from megatrain.inference.vision import complete_with_images, image_processor_for, is_vision_model, open_image

    images = [open_image(path, f"--image {path}") for path in args.image]  # before the (slow) model load
    model, meta = load_model(args.load, device, args.ckpt_step, tp_mesh=tp_mesh)
    vision = is_vision_model(model)
    if images and not vision:
        raise ValueError(f"--image: the checkpoint --load {args.load} is a text-only model (family "
                         f"{meta.get('family', 'gpt')}); images need a vision-language (LLaVA) checkpoint")
    model.to(model_dtype(args))
    first_rank = tp_mesh is None or dist.get_rank() == 0
    tokenizer = build_tokenizer(fill_tokenizer_args(args, meta))
    params = SamplingParams(args.tokens_to_generate, args.greedy, args.temperature, args.top_k, args.top_p,
                            args.seed, list(args.stop))
    results = []
    seq2seq = is_encoder_decoder(model)
    if vision:
        completions = complete_with_images(model, tokenizer, prompts, images, params, args.micro_batch_size,
                                           image_processor_for(model, meta.get("args")))
    else:
        completions = complete(model, tokenizer, prompts, params, args.micro_batch_size)
    for c in completions:
        results.append({"prompt": c.prompt, "text": c.text, "tokens": c.tokens})
        if first_rank:  # an encoder-decoder's output is not a continuation of its input
            print(f"--- prompt: {c.prompt!r}\n{c.text if seq2seq else c.prompt + c.text}\n", flush=True)
    if args.output_json and first_rank:
        atomic_write_json(args.output_json, results)
    sys.stdout.flush()


def tensor_parallel_mesh(args: argparse.Namespace, device: torch.device) -> DeviceMesh | None:
    """Under torchrun, a 1-D mesh over all processes for --tensor-model-parallel-size; else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tensor_model_parallel_size:
        raise SystemExit(f"error: --tensor-model-parallel-size {args.tensor_model_parallel_size} must equal the "
                         f"number of processes ({world}); launch with torchrun --nproc_per_node "
                         f"{args.tensor_model_parallel_size}")
    if world == 1:
        return None
    init_distributed(device)
    return init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
