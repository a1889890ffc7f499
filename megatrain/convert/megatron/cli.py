"""``tools/checkpoint/convert.py``: Megatron-LM's checkpoint converter command line.

``--model-type GPT --loader L --saver S --load-dir IN --save-dir OUT`` with Megatron's loader and
saver names: ``megatron`` (legacy torch format) and ``mcore`` (torch_dist; either loader reads both
formats, the one found is said), ``hf`` / ``llama_mistral`` (a Hugging Face folder, through
megatrain's HF import; ``--checkpoint-type meta`` is refused), ``megatrain`` (megatrain's own
checkpoints). Savers: ``megatrain``, ``mcore``, ``megatron`` (under ``--target-tensor-parallel-size``
x ``--target-pipeline-parallel-size``), ``hf``. Conversions between other formats pass through a
megatrain checkpoint in a temporary directory. ``--megatron-path`` is accepted and unused (megatrain
needs no Megatron-LM source tree: a note says so).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile

from megatrain.convert.megatron.args import config_from_megatron_args, megatron_args
from megatrain.convert.megatron.bridge import TOKENIZER_ARGS, export_megatron, import_megatron, optimizer_note
from megatrain.convert.megatron.reader import read_megatron_checkpoint
from megatrain.convert.megatron.writer import write_legacy, write_torch_dist
from megatrain.errors import user_errors_exit
from megatrain.flags import OneLineArgumentParser

__all__ = ["build_parser", "convert", "main", "LOADERS", "SAVERS"]

LOADERS = ("megatron", "mcore", "llama_mistral", "hf", "megatrain")
SAVERS = ("megatrain", "mcore", "megatron", "hf")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="tools/checkpoint/convert.py", allow_abbrev=False,
                                description="Convert checkpoints between Megatron-LM, megatrain and Hugging Face "
                                            "formats (Megatron-LM's tools/checkpoint/convert.py command line).")
    p.add_argument("--model-type", required=True, choices=["GPT"], help="the model type (GPT: GPT-2/LLaMA style)")
    p.add_argument("--loader", required=True, choices=LOADERS, help="the format of --load-dir")
    p.add_argument("--saver", required=True, choices=SAVERS, help="the format to write into --save-dir")
    p.add_argument("--load-dir", required=True, help="the checkpoint (or Hugging Face folder) to read")
    p.add_argument("--save-dir", required=True, help="where to write the converted checkpoint")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1,
                   help="TP size of a --saver megatron checkpoint; the vocabulary padding of an HF import")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1,
                   help="PP size of a --saver megatron checkpoint")
    p.add_argument("--tokenizer-model", default=None, help="tokenizer file recorded with the converted checkpoint")
    p.add_argument("--megatron-path", default=None,
                   help="accepted for Megatron-LM's scripts; unused (megatrain reads Megatron checkpoints itself)")
    p.add_argument("--checkpoint-type", choices=["hf", "meta"], default="hf",
                   help="--loader llama_mistral: a Hugging Face folder (meta's consolidated .pth files are refused)")
    p.add_argument("--saver-transformer-impl", choices=["transformer_engine", "local"], default="transformer_engine",
                   help="--saver megatron: the norm names of the layer spec the Megatron run uses")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="--loader hf/llama_mistral: the vocabulary padding (as the training script pads it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _check(args: argparse.Namespace) -> None:
    if args.target_tensor_parallel_size < 1 or args.target_pipeline_parallel_size < 1:
        raise ValueError("--target-tensor-parallel-size and --target-pipeline-parallel-size must be at least 1")
    if args.loader in ("hf", "llama_mistral") and args.saver == "hf" or args.loader == args.saver == "megatrain":
        raise ValueError(f"--loader {args.loader} --saver {args.saver}: nothing to convert (same format)")
    if args.loader == "llama_mistral" and args.checkpoint_type == "meta":
        raise ValueError("--checkpoint-type meta: Meta's consolidated.*.pth files are not read; convert them to a "
                         "Hugging Face folder with transformers' convert_llama_weights_to_hf.py, then use "
                         "--checkpoint-type hf")
    if not os.path.exists(args.load_dir):
        raise ValueError(f"--load-dir {args.load_dir}: no such file or directory")
    if args.saver != "megatron" and args.target_pipeline_parallel_size > 1:
        print(f" note: --target-pipeline-parallel-size applies to --saver megatron only; a {args.saver} checkpoint "
              "loads under any layout", flush=True)


def _megatron_to_megatron(args: argparse.Namespace, progress: bool) -> str:
    ck = read_megatron_checkpoint(args.load_dir, progress=progress)
    print(f" read the Megatron-LM {ck.format} checkpoint {ck.path} (iteration {ck.iteration})", flush=True)
    cfg = config_from_megatron_args(ck.args, ck.path)
    saved = vars(ck.args)
    tensors = dict(ck.tensors)
    if not cfg.untie_embeddings_and_output_weights:
        tensors.pop("output_layer.weight", None)
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    margs = megatron_args(cfg, tp=tp, pp=pp, iteration=ck.iteration, consumed_train_samples=ck.consumed_train_samples,
                          consumed_valid_samples=ck.consumed_valid_samples,
                          tokenizer={k: saved.get(k) for k in TOKENIZER_ARGS},
                          ckpt_format="torch_dist" if args.saver == "mcore" else "torch",
                          transformer_impl=args.saver_transformer_impl, seq_length=saved.get("seq_length"))
    note = optimizer_note(ck)
    if note:
        print(" " + note, flush=True)
    elif ck.optimizer is not None:
        print(f" note: {ck.path}: its optimizer state is not written (a conversion between Megatron formats "
              "carries the weights; convert to megatrain and back for Adam's state)", flush=True)
    if args.saver == "mcore":
        return write_torch_dist(args.save_dir, tensors, margs, ck.iteration, ck.scheduler)
    return write_legacy(args.save_dir, tensors, margs, ck.iteration, tp=tp, pp=pp,
                        transformer_impl=args.saver_transformer_impl, progress=progress, scheduler=ck.scheduler)


def convert(args: argparse.Namespace) -> str:
    """Run one conversion; returns what was written."""
    _check(args)
    if args.megatron_path:
        print(f" note: --megatron-path {args.megatron_path} is not used (megatrain reads and writes Megatron "
              "checkpoints itself)", flush=True)
    progress = not args.no_progress
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    megatron_in = args.loader in ("megatron", "mcore")
    if megatron_in and args.saver in ("mcore", "megatron"):
        out = _megatron_to_megatron(args, progress)
    elif megatron_in and args.saver == "megatrain":
        out = import_megatron(args.load_dir, args.save_dir, progress=progress).path
    else:
        with tempfile.TemporaryDirectory(prefix="megatrain-convert-") as scratch:
            source = args.load_dir
            if megatron_in:  # -> hf
                source = import_megatron(args.load_dir, os.path.join(scratch, "ckpt"), progress=progress,
                                         quiet=True).path
            elif args.loader in ("hf", "llama_mistral"):
                from megatrain.convert.import_hf import import_hf_model

                target = args.save_dir if args.saver == "megatrain" else os.path.join(scratch, "ckpt")
                printed = io.StringIO()  # an intermediate's "continue from it with ..." advice would mislead
                with contextlib.redirect_stdout(printed) if target != args.save_dir else contextlib.nullcontext():
                    source = import_hf_model(args.load_dir, target,
                                             make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                             tensor_model_parallel_size=tp, progress=progress)
                if args.saver == "megatrain":
                    return source
            if args.saver == "hf":
                from megatrain.convert.export_hf import export_checkpoint

                export_checkpoint(source, args.save_dir, progress=progress,
                                  tokenizer_overrides={"tokenizer_model": args.tokenizer_model}
                                  if args.tokenizer_model else None)
                out = args.save_dir
            else:
                out = export_megatron(source, args.save_dir, saver=args.saver, tp=tp, pp=pp,
                                      transformer_impl=args.saver_transformer_impl, progress=progress)
    print(f" wrote a {args.saver} checkpoint: {out}", flush=True)
    return out


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    convert(build_parser().parse_args(argv))
