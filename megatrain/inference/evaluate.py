"""`tools/evaluate.py`: loss and perplexity of a checkpoint on a preprocessed dataset or a jsonl file, and
LAMBADA-style last-word accuracy.

Loss/perplexity: the documents (``.bin/.idx`` sequences, or jsonl ``--json-key`` texts tokenized with an
EOD appended) are joined into one token stream and cut into consecutive windows of ``--seq-length``
+ 1 tokens; the loss is the mean cross entropy over every predicted token, the perplexity
exp(min(20, loss)) as in Megatron's validation line.

Last-word accuracy (``--lambada FILE``, jsonl of ``{"text": ...}``): the text without its last
word is the context; a sample counts as correct when greedy decoding reproduces every token of
the last word (teacher-forced argmax at each of its positions, the same as greedy generation).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator

import numpy as np
import torch

from megatrain.atomic_io import atomic_write_json
from megatrain.data.jsonl import iter_jsonl
from megatrain.data.tokenizers import add_tokenizer_args, build_tokenizer
from megatrain.errors import user_errors_exit
from megatrain.inference.loading import fill_tokenizer_args, load_model
from megatrain.inference.seq2seq import is_encoder_decoder
from megatrain.inference.text_generation import model_dtype
from megatrain.training.builders import choose_device
from megatrain.flags import OneLineArgumentParser


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="evaluate.py", allow_abbrev=False,
                                description="Loss/perplexity and LAMBADA-style accuracy of a megatrain checkpoint.")
    p.add_argument("--load", required=True, help="checkpoint directory (a --save directory or one iter_ folder)")
    p.add_argument("--ckpt-step", type=int, default=None)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data-path", help="prefix of a preprocessed .bin/.idx dataset")
    src.add_argument("--jsonl", help="jsonl file of documents")
    src.add_argument("--lambada", help='jsonl file of {"text": ...}: predict each text\'s last word')
    p.add_argument("--json-key", default="text", help="key of the text in --jsonl / --lambada lines")
    p.add_argument("--seq-length", type=int, default=None,
                   help="window length for loss/perplexity (default: the checkpoint's --seq-length)")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--max-samples", type=int, default=None, help="evaluate at most this many windows/texts")
    p.add_argument("--output-json", default=None, help="write the results here")
    p.add_argument("--device", default=None)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true")
    add_tokenizer_args(p)
    return p


def _read_jsonl_texts(path: str, key: str, flag: str) -> Iterator[str]:
    for lineno, obj in iter_jsonl(path, flag):
        if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
            raise ValueError(f"{flag} {path}:{lineno}: expected an object with a string {key!r}")
        yield obj[key]


def token_windows(stream: Iterator[np.ndarray], length: int) -> Iterator[np.ndarray]:
    """Consecutive windows of ``length`` tokens from a stream of token arrays (the tail is dropped)."""
    buffer = np.zeros(0, dtype=np.int64)
    for piece in stream:
        buffer = np.concatenate([buffer, np.asarray(piece, dtype=np.int64)])
        while len(buffer) >= length:
            yield buffer[:length]
            buffer = buffer[length:]


@torch.no_grad()
def loss_and_perplexity(model, windows: Iterator[np.ndarray], micro_batch_size: int,
                        max_samples: int | None = None) -> dict[str, float]:
    device = next(model.parameters()).device
    total, count, samples = 0.0, 0, 0
    batch: list[np.ndarray] = []

    def flush() -> None:
        nonlocal total, count
        x = torch.from_numpy(np.stack(batch)).to(device)
        per_token = model(x[:, :-1], labels=x[:, 1:])
        total += float(per_token.double().sum())
        count += per_token.numel()
        batch.clear()

    for w in windows:
        if max_samples is not None and samples >= max_samples:
            break
        batch.append(w)
        samples += 1
        if len(batch) == micro_batch_size:
            flush()
    if batch:
        flush()
    if count == 0:
        raise ValueError("not enough tokens for one window of --seq-length + 1 tokens")
    loss = total / count
    return {"lm loss": loss, "lm loss PPL": math.exp(min(20.0, loss)), "windows": samples, "tokens": count}


def split_last_word(text: str, tokenizer) -> tuple[list[int], list[int]]:
    """(context ids, last-word ids): the text without its last (space-separated) word, and that word."""
    text = text.rstrip()
    cut = text.rfind(" ")
    if cut <= 0:
        raise ValueError("needs at least two words")
    context_ids = tokenizer.tokenize(text[:cut])
    full_ids = tokenizer.tokenize(text)
    if full_ids[:len(context_ids)] == context_ids and len(full_ids) > len(context_ids):
        return context_ids, full_ids[len(context_ids):]
    return context_ids, tokenizer.tokenize(text[cut:])


@torch.no_grad()
def last_word_accuracy(model, tokenizer, texts: Iterator[str], max_samples: int | None = None,
                       flag: str = "--lambada") -> dict[str, float]:
    device = next(model.parameters()).device
    correct = total = 0
    for i, text in enumerate(texts):
        if max_samples is not None and total >= max_samples:
            break
        try:
            context, target = split_last_word(text, tokenizer)
        except ValueError as e:
            raise ValueError(f"{flag} text {i + 1}: {e}") from None
        if not context or not target:
            raise ValueError(f"{flag} text {i + 1}: the context or the last word has no tokens")
        ids = torch.tensor([context + target[:-1]], device=device)
        predicted = model(ids)[0, len(context) - 1:].argmax(-1).tolist()
        correct += int(predicted == target)
        total += 1
    if total == 0:
        raise ValueError(f"{flag}: no texts")
    return {"last-word accuracy": correct / total, "correct": correct, "texts": total}


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.micro_batch_size <= 0:
        raise SystemExit("error: --micro-batch-size must be positive")
    model, meta = load_model(args.load, choose_device(args.device), args.ckpt_step)
    if is_encoder_decoder(model):
        raise SystemExit(f"error: --load {args.load} holds an encoder-decoder (T5) model: this tool measures a "
                         "left-to-right language model's loss; fine-tune it with finetune.py (validation loss) or "
                         "generate with tools/generate.py")
    model.to(model_dtype(args))
    tokenizer = build_tokenizer(fill_tokenizer_args(args, meta))
    if args.lambada:
        texts = _read_jsonl_texts(args.lambada, args.json_key, "--lambada")
        results = last_word_accuracy(model, tokenizer, texts, args.max_samples)
        print(f" LAMBADA-style evaluation | last-word accuracy: {results['last-word accuracy']:.4f} "
              f"({results['correct']}/{results['texts']}) |", flush=True)
    else:
        seq_length = args.seq_length or meta.get("args", {}).get("seq_length") or model.config.max_position_embeddings
        if seq_length <= 0:
            raise SystemExit("error: --seq-length must be positive")
        if model.config.position_embedding_type == "learned_absolute" and seq_length > \
                model.config.max_position_embeddings:
            raise SystemExit(f"error: --seq-length {seq_length} exceeds the model's --max-position-embeddings "
                             f"({model.config.max_position_embeddings})")
        if args.data_path:
            from megatrain.data.indexed_dataset import IndexedDataset, dataset_exists

            if not dataset_exists(args.data_path):
                raise SystemExit(f"error: --data-path {args.data_path}: no {args.data_path}.bin/.idx")
            data = IndexedDataset(args.data_path)
            stream: Iterator[np.ndarray] = (data[i] for i in range(len(data)))
            source = args.data_path
        else:
            eod = [tokenizer.eod] if tokenizer.eod is not None else []
            stream = (np.asarray(tokenizer.tokenize(t) + eod)
                      for t in _read_jsonl_texts(args.jsonl, args.json_key, "--jsonl"))
            source = args.jsonl
        results = loss_and_perplexity(model, token_windows(stream, seq_length + 1), args.micro_batch_size,
                                      args.max_samples)
        print(f" evaluation on {source} ({results['windows']} windows of {seq_length} tokens) | lm loss value: "
              f"{results['lm loss']:.6E} | lm loss PPL: {results['lm loss PPL']:.6E} |", flush=True)
    if args.output_json:
        atomic_write_json(args.output_json, results)
    sys.stdout.flush()
