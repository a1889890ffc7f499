"""`tools/fill_mask.py` / `megatrain fill-mask`: a BERT checkpoint's most likely tokens for each
``[MASK]`` of a text.

A text is tokenized around every literal ``[MASK]`` (WordPiece would otherwise split it into ``[``,
``mask``, ``]``), each becoming the tokenizer's mask id; the model sees ``[CLS] text [SEP]`` (token
type 0, texts of a micro-batch padded and the padding masked) and its masked-LM head gives, at each
mask, a distribution over the tokenizer's vocabulary (the padding rows of the embedding table are
left out). :func:`fill_mask` is the text-in, predictions-out layer; :func:`main` the command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
from torch import nn

from megatrain import checkpoint as checkpointing
from megatrain.data.jsonl import iter_jsonl
from megatrain.data.tokenizers import add_tokenizer_args, build_tokenizer
from megatrain.errors import user_errors_exit
from megatrain.inference.loading import fill_tokenizer_args, load_model
from megatrain.models.bert.classification import META_KEY as CLASSIFICATION_META_KEY
from megatrain.training.builders import choose_device
from megatrain.flags import OneLineArgumentParser

__all__ = ["MASK_TEXT", "MASKED_LM_FAMILIES", "Prediction", "MaskPrediction", "FillMaskResult",
           "tokenize_with_masks", "fill_mask", "masked_lm_checkpoint", "masked_lm_hint", "build_parser", "main"]

MASK_TEXT = "[MASK]"
MASKED_LM_FAMILIES = ("bert",)  # the families whose checkpoints predict masked tokens (not left to right)


@dataclass
class Prediction:
    token: str  # the vocabulary entry ("##ing" for a word piece)
    id: int
    probability: float


@dataclass
class MaskPrediction:
    position: int  # the mask's index in the model's input ([CLS] is 0)
    predictions: list[Prediction]  # the top-k, most likely first


@dataclass
class FillMaskResult:
    text: str
    tokens: list[int]  # the model's input: [CLS] ... [SEP]
    masks: list[MaskPrediction]
    filled: str  # the text with every mask replaced by its most likely token (detokenized)


def tokenize_with_masks(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with each literal ``[MASK]`` as the tokenizer's mask id (the pieces
    between masks are tokenized on their own)."""
    mask = getattr(tokenizer, "mask", None)
    if mask is None:
        raise ValueError(f"the tokenizer ({getattr(tokenizer, 'name', type(tokenizer).__name__)}) has no [MASK] "
                         "token; fill-mask needs BERT's WordPiece tokenizer")
    ids: list[int] = []
    for i, piece in enumerate(text.split(MASK_TEXT)):
        if i:
            ids.append(mask)
        if piece.strip():
            ids += tokenizer.tokenize(piece)
    return ids


def _token_string(tokenizer: Any, token_id: int) -> str:
    inv = getattr(tokenizer, "inv_vocab", None)
    if inv is not None and token_id in inv:
        return inv[token_id]
    return tokenizer.detokenize([token_id])


@torch.no_grad()
def fill_mask(model: nn.Module, tokenizer: Any, texts: Sequence[str], top_k: int = 5,
              micro_batch_size: int | None = None, sources: Sequence[str] | None = None) -> list[FillMaskResult]:
    """The ``top_k`` tokens (with probabilities) for every ``[MASK]`` of every text. ``sources`` names
    each text in errors (``--text``, ``FILE:LINE``); a text without a mask, or longer than the
    model's positions, raises ValueError."""
    if top_k < 1:
        raise ValueError(f"--top-k must be at least 1, got {top_k}")
    for attr in ("cls", "sep", "pad"):
        if getattr(tokenizer, attr, None) is None:
            raise ValueError(f"the tokenizer has no {attr} token; fill-mask needs BERT's WordPiece tokenizer")
    config = getattr(model, "config", None)
    max_len = getattr(config, "max_position_embeddings", None)
    learned = getattr(config, "position_embedding_type", "learned_absolute") == "learned_absolute"
    sources = list(sources) if sources is not None else [f"text {i + 1}" for i in range(len(texts))]
    inputs: list[list[int]] = []
    for text, source in zip(texts, sources):
        ids = [tokenizer.cls, *tokenize_with_masks(tokenizer, text), tokenizer.sep]
        if tokenizer.mask not in ids:
            raise ValueError(f"{source}: no {MASK_TEXT} in {_short(text)} (write {MASK_TEXT} where a token is to be "
                             "predicted)")
        if learned and max_len is not None and len(ids) > max_len:
            raise ValueError(f"{source}: {len(ids)} tokens with [CLS] and [SEP], more than the model's "
                             f"{max_len} positions")
        inputs.append(ids)
    vocab = int(tokenizer.vocab_size)
    device = next(model.parameters()).device
    size = micro_batch_size or len(inputs) or 1
    out: list[FillMaskResult] = []
    for start in range(0, len(inputs), size):
        chunk = inputs[start:start + size]
        length = max(len(ids) for ids in chunk)
        tokens = torch.full((len(chunk), length), tokenizer.pad, dtype=torch.long)
        padding = torch.zeros((len(chunk), length), dtype=torch.bool)
        for row, ids in enumerate(chunk):
            tokens[row, :len(ids)] = torch.tensor(ids)
            padding[row, :len(ids)] = True
        tokens, padding = tokens.to(device), padding.to(device)
        logits, _ = model(tokens, padding_mask=padding, tokentype_ids=torch.zeros_like(tokens))
        logits = logits.float()[..., :vocab]  # the embedding table's padding rows are no tokens
        for row, ids in enumerate(chunk):
            positions = [j for j, t in enumerate(ids) if t == tokenizer.mask]
            probs = torch.softmax(logits[row, positions], dim=-1)
            top = torch.topk(probs, min(top_k, vocab), dim=-1)
            masks = [MaskPrediction(pos, [Prediction(_token_string(tokenizer, int(i)), int(i), float(p))
                                          for p, i in zip(top.values[k].tolist(), top.indices[k].tolist())])
                     for k, pos in enumerate(positions)]
            best = list(ids)
            for m in masks:
                best[m.position] = m.predictions[0].id
            out.append(FillMaskResult(texts[start + row], list(ids), masks, tokenizer.detokenize(best[1:-1])))
    return out


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


# ---- checkpoints ---------------------------------------------------------------------------------

def masked_lm_checkpoint(load: str, step: int | None = None) -> tuple[str, dict[str, Any]]:
    """(checkpoint directory, meta) of ``--load`` when it holds a masked language model; one-line
    errors for no checkpoint, another family (GPT) or a classification fine-tuning checkpoint."""
    ckpt = checkpointing.find_checkpoint(load, step, verify=False)
    if ckpt is None:
        raise SystemExit(f"error: --load {load}: no checkpoint found")
    meta = checkpointing.read_meta(ckpt)
    family = checkpointing.checkpoint_family(meta)
    if family not in MASKED_LM_FAMILIES:
        raise SystemExit(f"error: --load {ckpt} holds a {family!r} model, which has no masked-LM head; fill-mask "
                         "needs a BERT checkpoint (generate text with tools/generate.py / megatrain generate)")
    if CLASSIFICATION_META_KEY in meta:
        raise SystemExit(f"error: --load {ckpt} is a BERT classification checkpoint (finetune.py): it has no "
                         "masked-LM head; give the pre-trained BERT checkpoint")
    return ckpt, meta


def masked_lm_hint(load: str, step: int | None = None) -> str | None:
    """For tools that generate text left to right: one line telling to use fill-mask when ``--load``
    holds a masked language model (BERT), else None."""
    try:
        ckpt = checkpointing.find_checkpoint(load, step, verify=False)
        family = checkpointing.checkpoint_family(checkpointing.read_meta(ckpt)) if ckpt else None
    except (OSError, ValueError):
        return None  # the loader reports it
    if family not in MASKED_LM_FAMILIES:
        return None
    return (f"--load {ckpt} holds a {family.upper()} model, a masked language model that does not generate text "
            f"left to right; predict masked tokens with tools/fill_mask.py --load {load} --text \"... {MASK_TEXT} "
            "...\" (megatrain fill-mask)")


# ---- command line --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="fill_mask.py", allow_abbrev=False,
                                description="Predict the tokens at each [MASK] with a BERT checkpoint.")
    p.add_argument("--load", required=True, help="checkpoint directory (a --save directory or one iter_ folder)")
    p.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    p.add_argument("--text", action="append", default=[], help='a text with one or more [MASK] (repeatable)')
    p.add_argument("--input-file", default=None,
                   help='texts: a .jsonl/.json file of {"text": ...} objects (or JSON strings), else one text a line')
    p.add_argument("--top-k", type=int, default=5, help="tokens shown for each mask (default 5)")
    p.add_argument("--json", action="store_true",
                   help='print one JSON object per text: {"text", "tokens", "masks": [{"position", "predictions": '
                        '[{"token", "id", "probability"}]}], "filled"}')
    p.add_argument("--micro-batch-size", type=int, default=32, help="texts run through the model together")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--bf16", action="store_true", help="run the model in bfloat16")
    p.add_argument("--fp16", action="store_true", help="run the model in float16")
    add_tokenizer_args(p)
    return p


def read_texts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(texts, where each comes from) of ``--text`` and ``--input-file``."""
    texts = list(args.text)
    sources = [f"--text {i + 1}" for i in range(len(texts))]
    path = args.input_file
    if path:
        if path.endswith((".jsonl", ".json")):
            for lineno, obj in iter_jsonl(path, "--input-file"):
                text = obj.get("text") if isinstance(obj, dict) else obj
                if not isinstance(text, str):
                    raise ValueError(f"--input-file {path}:{lineno}: expected a JSON object with a string \"text\" "
                                     "(or a JSON string)")
                texts.append(text)
                sources.append(f"--input-file {path}:{lineno}")
        else:
            try:
                with open(path, encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"--input-file {path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
            for lineno, line in enumerate(lines, 1):
                if line.strip():
                    texts.append(line)
                    sources.append(f"--input-file {path}:{lineno}")
    if not texts:
        raise SystemExit("error: give at least one --text (with [MASK]) or an --input-file")
    return texts, sources


def _dtype(args: argparse.Namespace) -> torch.dtype:
    if args.bf16 and args.fp16:
        raise SystemExit("error: --bf16 and --fp16 cannot be used together")
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def format_result(r: FillMaskResult) -> str:
    lines = [f"--- text: {r.text!r}"]
    for k, m in enumerate(r.masks, 1):
        lines.append(f"{MASK_TEXT} {k}: " + " | ".join(f"{p.token} {p.probability:.4f}" for p in m.predictions))
    lines.append(f"filled: {r.filled}")
    return "\n".join(lines) + "\n"


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.top_k < 1:
        raise SystemExit(f"error: --top-k must be at least 1, got {args.top_k}")
    if args.micro_batch_size <= 0:
        raise SystemExit("error: --micro-batch-size must be positive")
    dtype = _dtype(args)
    texts, sources = read_texts(args)
    ckpt, meta = masked_lm_checkpoint(args.load, args.ckpt_step)
    tokenizer = build_tokenizer(fill_tokenizer_args(args, meta))
    for text, source in zip(texts, sources):  # before the model loads: a text without a mask is refused at once
        if getattr(tokenizer, "mask", None) is not None and MASK_TEXT not in text:
            raise ValueError(f"{source}: no {MASK_TEXT} in {_short(text)} (write {MASK_TEXT} where a token is to be "
                             "predicted)")
    device = choose_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    model, _ = load_model(ckpt, device)
    model.to(dtype)
    results = fill_mask(model, tokenizer, texts, args.top_k, args.micro_batch_size, sources)
    if args.json:
        for r in results:  # JSON Lines: one object per text
            print(json.dumps(asdict(r), ensure_ascii=False), flush=True)
    else:
        for r in results:
            print(format_result(r), flush=True)
    sys.stdout.flush()
