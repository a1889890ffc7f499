"""Supervised fine-tuning data: jsonl of prompt/response pairs or chat messages, loss on the response only.

Each jsonl line is one example, either

    {"prompt": "...", "response": "..."}                    (keys set by --sft-prompt-key/--sft-response-key)
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}

Prompt/response: ``tokens(prompt) + tokens(response) + [EOD]``; the response tokens and the EOD are
trained on. Chat messages use this template (``CHAT_TEMPLATE``), each piece tokenized on its own:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n ... EOD

The role headers and every non-assistant message carry no loss; an assistant message's content and
its closing newline do, and so does the final EOD when the last message is the assistant's.
A ``HuggingFaceTokenizer`` whose folder has a chat template (``chat_template.jinja`` or
``tokenizer_config.json`` ``chat_template``) renders chats with that template instead, in jinja2's
sandbox, to the ids of transformers' ``apply_chat_template(messages)`` (no EOD appended: the template
ends the turn); the loss covers each assistant turn as the template writes it (see
``megatrain/data/tokenizers/chat_template.py``).

A sample is a dict of int64 arrays [seq_length + 1]: ``tokens`` (token ids), ``targets`` (``1`` where
the token is a training target), ``segments`` (the example's number, 1, 2, ... ; 0 for padding). ``--sft-pack``
packs several examples into one sample (attention and position ids restart per example);
otherwise each sample holds one example, padded at the end. Over-long examples are truncated.
`sft_batch` turns a collated batch of samples into a causal-LM batch with its own loss mask.

The order is deterministic (seeded per epoch) and independent of the parallel layout.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from megatrain.data.batch import CausalLMBatch, packed_attention

from megatrain.data.gpt_dataset import parse_split, split_matrix_from_vector, split_ranges
from megatrain.data.jsonl import iter_jsonl

__all__ = ["SFTConfig", "SFTExample", "SFTDataset", "read_sft_jsonl", "tokenize_example", "pack_examples",
           "build_sft_datasets", "sft_batch", "CHAT_ROLES", "CHAT_TEMPLATE"]

CHAT_ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE = "<|{role}|>\n{content}\n"


@dataclass
class SFTConfig:
    seq_length: int
    pack: bool = False
    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: str = "messages"


@dataclass
class SFTExample:
    tokens: list[int]
    targets: list[bool]  # targets[j]: token j is predicted (from token j - 1) and counted in the loss


def read_sft_jsonl(path: str, config: SFTConfig) -> list[tuple[str, int, dict[str, Any]]]:
    """(path, line number, object) of every non-empty line; bad lines raise ValueError naming them."""
    out = []
    for lineno, obj in iter_jsonl(path, "--data-path"):
        _check_example(obj, path, lineno, config)
        out.append((path, lineno, obj))
    if not out:
        raise ValueError(f"--data-path {path}: no examples (the file is empty)")
    return out


def _check_example(obj: Any, path: str, lineno: int, c: SFTConfig) -> None:
    where = f"{path}:{lineno}"
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if c.messages_key in obj:
        messages = obj[c.messages_key]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: {c.messages_key!r} must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: message {i} must be {{\"role\": one of {list(CHAT_ROLES)}, "
                                 f"\"content\": a string}}")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: no assistant message, so nothing to train on")
        return
    for key in (c.prompt_key, c.response_key):
        if not isinstance(obj.get(key), str):
            raise ValueError(f"{where}: expected string keys {c.prompt_key!r} and {c.response_key!r} "
                             f"(or a {c.messages_key!r} list)")
    if not obj[c.response_key]:
        raise ValueError(f"{where}: empty {c.response_key!r}")


def tokenize_example(obj: dict[str, Any], tokenizer: Any, config: SFTConfig) -> SFTExample:
    """Token ids and loss targets of one example (pieces tokenized separately, joined)."""
    if tokenizer.eod is None:
        raise ValueError("fine-tuning needs a tokenizer with an end-of-document token (EOD)")
    pieces: list[tuple[str, bool]]
    if (config.messages_key in obj and getattr(tokenizer, "name", None) == "HuggingFaceTokenizer"
            and getattr(tokenizer, "chat_template", None) is not None):
        # The model's own template (--tokenizer-type HuggingFaceTokenizer; SFTTokenizer has its prompt
        # formats): transformers' apply_chat_template ids, the loss on what the assistant wrote.
        tokens, targets = tokenizer.chat_with_targets(obj[config.messages_key])
        if targets:
            targets[0] = False  # the first token is never predicted
        return SFTExample(list(tokens), list(targets))
    if config.messages_key in obj:
        pieces = []
        for m in obj[config.messages_key]:
            pieces.append((CHAT_TEMPLATE.split("{content}")[0].format(role=m["role"]), False))
            pieces.append((m["content"] + "\n", m["role"] == "assistant"))
        final_target = obj[config.messages_key][-1]["role"] == "assistant"
    else:
        pieces = [(obj[config.prompt_key], False), (obj[config.response_key], True)]
        final_target = True
    tokens: list[int] = []
    targets: list[bool] = []
    bos = getattr(tokenizer, "bos", None)
    for i, (text, is_target) in enumerate(pieces):
        ids = tokenizer.tokenize(text) if text else []
        if i > 0 and bos is not None and ids and ids[0] == bos:
            ids = ids[1:]  # tokenizers that prepend BOS (Llama2Tokenizer): only at the very start
        tokens += ids
        targets += [is_target] * len(ids)
    tokens.append(tokenizer.eod)
    targets.append(final_target)
    if targets:
        targets[0] = False  # the first token is never predicted
    return SFTExample(tokens, targets)


def pack_examples(lengths: Sequence[int], capacity: int, pack: bool) -> list[list[int]]:
    """Bins of example indices: one per bin, or (pack) greedily filled in order up to ``capacity`` tokens."""
    if not pack:
        return [[i] for i in range(len(lengths))]
    bins: list[list[int]] = []
    used = capacity
    for i, n in enumerate(lengths):
        n = min(n, capacity)
        if used + n > capacity:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += n
    return bins


class SFTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples over the bins of ``examples``, reshuffled every epoch with ``seed``."""

    def __init__(self, examples: list[SFTExample], seq_length: int, num_samples: int, seed: int, pad_id: int,
                 pack: bool = False, name: str = "train"):
        if not examples:
            raise ValueError(f"the {name} split has no fine-tuning examples")
        self.examples = examples
        self.capacity = seq_length + 1
        self.pad_id = pad_id
        self.bins = pack_examples([len(e.tokens) for e in examples], self.capacity, pack)
        self.num_samples = max(int(num_samples), len(self.bins))
        self.seed = seed
        self._orders: dict[int, np.ndarray] = {}
        truncated = sum(len(e.tokens) > self.capacity for e in examples)
        if truncated:
            warnings.warn(f"{truncated} of {len(examples)} {name} examples are longer than --seq-length + 1 "
                          f"({self.capacity} tokens) and are truncated")

    def __len__(self) -> int:
        return self.num_samples

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders[epoch] = np.random.RandomState(self.seed + epoch).permutation(len(self.bins))
        return self._orders[epoch]

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        epoch, pos = divmod(int(index), len(self.bins))
        sample = np.zeros((3, self.capacity), dtype=np.int64)
        sample[0] = self.pad_id
        start = 0
        for segment, i in enumerate(self.bins[self._order(epoch)[pos]], 1):
            e = self.examples[i]
            n = min(len(e.tokens), self.capacity - start)
            sample[0, start:start + n] = e.tokens[:n]
            sample[1, start:start + n] = e.targets[:n]
            sample[1, start] = 0  # never predict across an example boundary
            sample[2, start:start + n] = segment
            start += n
        return {"tokens": sample[0], "targets": sample[1], "segments": sample[2]}


def build_sft_datasets(data_paths: Sequence[str] | None, split: str, tokenizer: Any, config: SFTConfig,
                       num_samples: Sequence[int], seed: int,
                       per_split_paths: Sequence[Sequence[str] | None] | None = None
                       ) -> tuple[SFTDataset | None, SFTDataset | None, SFTDataset | None]:
    """Train/valid/test datasets from jsonl files: ``--split`` over the examples of ``data_paths`` in
    file order, or one list of files per split (``--train-data-path`` ...)."""
    def load(paths: Sequence[str]) -> list[SFTExample]:
        out = []
        for path in paths:
            for p, lineno, obj in read_sft_jsonl(path, config):
                try:
                    out.append(tokenize_example(obj, tokenizer, config))
                except ValueError as e:
                    raise ValueError(f"{p}:{lineno}: {e}") from None
        return out

    if per_split_paths is not None:
        groups = [load(paths) if paths else [] for paths in per_split_paths]
    else:
        if not data_paths:
            raise ValueError("fine-tuning needs --data-path (jsonl files) or --train-data-path")
        for p in data_paths:
            if _is_number(p):
                raise ValueError(f"--data-path {p}: weighted blends are not supported for fine-tuning; "
                                 "list jsonl files")
        examples = load(data_paths)
        ranges = split_ranges(len(examples), split_matrix_from_vector(parse_split(split)))
        groups = [examples[r[0]:r[1]] if r else [] for r in ranges]
    pad = tokenizer.pad if getattr(tokenizer, "pad", None) is not None else tokenizer.eod
    out: list[SFTDataset | None] = []
    for name, group, n in zip(("train", "valid", "test"), groups, num_samples):
        if not group:
            if name == "train":
                raise ValueError("the train split has no fine-tuning examples (check --split / --train-data-path)")
            out.append(None)
            continue
        out.append(SFTDataset(group, config.seq_length, n, seed, pad, config.pack, name))
    return out[0], out[1], out[2]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def sft_batch(samples: dict[str, torch.Tensor]) -> CausalLMBatch:
    """Collated samples (``tokens``, ``targets``, ``segments``: int64 [b, s+1]) -> a causal-LM batch.

    Position ids restart at every example; with several examples in a row the attention mask keeps
    each example to itself (``None`` when every row holds one example: padding sits at the end, so
    causal attention already keeps it away from real tokens).
    """
    if not isinstance(samples, dict) or {"tokens", "targets", "segments"} - set(samples):
        raise ValueError("fine-tuning samples must be dicts of tokens, targets and segments "
                         f"[batch, seq_length+1], got {type(samples).__name__}")
    ids = samples["tokens"].long()
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"fine-tuning samples must be [batch, seq_length+1], got {tuple(ids.shape)}")
    tokens = ids[:, :-1].contiguous()
    labels = ids[:, 1:].contiguous()
    loss_mask = samples["targets"][:, 1:].float().contiguous()
    position_ids, attention_mask = packed_attention(samples["segments"][:, :-1].long())
    return CausalLMBatch(tokens, labels, loss_mask, position_ids, attention_mask)
