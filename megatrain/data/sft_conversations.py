"""Megatron-LM's SFT dataset (``pretrain_gpt.py --sft``): jsonl lines of chat conversations, one packed
sample per line, the loss on the assistant's tokens only.

Input (Megatron's ``SFTLowLevelDataset``): every non-blank line of a ``--data-path`` file is an object
whose ``"messages"`` is a list of ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``.
A line may hold several conversations one after another: each system message starts a new one.
``--data-path`` takes jsonl files the way it takes ``.bin/.idx`` prefixes (one file, a weighted
blend ``W1 FILE1 W2 FILE2``, several files, or ``--train/valid/test-data-path``), ``--split`` dividing
each file's lines (`megatrain.data.dataset_builder`).

Sample ``i`` (Megatron's ``SFTDataset.__getitem__``) is the line ``indices[i % len(indices)]`` of the
split, in file order (the dataset does not shuffle; ``--dataloader-type cyclic`` does). Its
conversations are tokenized by the ``SFTTokenizer``'s prompt format
(:meth:`megatrain.data.tokenizers.sft.SFTTokenizer.tokenize_conversation`) and joined; no EOD is
added (the format's text ends each turn). As soon as the pack holds ``seq_length + 1`` tokens or
more it is cut to ``seq_length`` tokens and one pad token, and the line's remaining conversations
are dropped; a shorter pack is filled with pad tokens up to ``seq_length + 1``. Tokens ``[:-1]`` are
the input and targets ``[1:]`` the labels; a label carries loss unless it is the pad token or
``IGNORE_INDEX`` (prompts, the format's assistant header). Attention stays inside each
conversation, the padding belonging to the last one; positions restart at each conversation
(Megatron's ``cu_seqlens`` and ``position_ids``).

The samples have the form of megatrain's fine-tuning samples (``tokens``, ``targets``: 1 where the
token is a label with loss, ``segments``: the conversation's number; int64 [seq_length + 1]), which
`megatrain.data.sft_dataset.sft_batch` turns into the causal-LM batch: the same inputs, loss mask,
positions and attention as Megatron's (labels differ only where the loss mask is 0).

Every line is read and tokenized once when the dataset is built, so that a bad line stops the run
before training with one line naming the file and line (also a bad conversation that a cut would
drop, which Megatron never looks at); samples read their line again from the file (nothing of the
text is held in memory).
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from megatrain.data.config import DataConfig
from megatrain.data.dataset_builder import SPLIT_NAMES, build_split_datasets
from megatrain.data.jsonl import iter_jsonl_at, parse_jsonl_line
from megatrain.data.tokenizers.sft import IGNORE_INDEX, TARGET_ROLES, ConversationError

__all__ = ["ConversationFile", "SFTConversationDataset", "build_conversation_datasets", "check_line",
           "pack_conversations", "split_conversations"]

#: Lines tokenized together while a dataset checks its lines.
_CHECK_CHUNK = 512


def split_conversations(messages: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The conversations of one line: a new one starts at every system message (Megatron's
    ``_split_conversations``)."""
    out: list[list[dict[str, Any]]] = []
    for message in messages:
        if message["role"] == "system" or not out:
            out.append([])
        out[-1].append(message)
    return out


def check_line(obj: Any, where: str) -> list[list[dict[str, Any]]]:
    """The conversations of one parsed line; a line that is not Megatron's SFT form raises ValueError
    naming ``where``."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with \"messages\", got {type(obj).__name__}")
    if "messages" not in obj:
        keys = ", ".join(map(repr, list(obj)[:5]))
        raise ValueError(f"{where}: no \"messages\" list (the keys are {keys or 'none'})")
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} must be an object with string \"role\" and \"content\"")
        if m["role"].lower() not in TARGET_ROLES:
            raise ValueError(f"{where}: message {i} has the unknown role {m['role']!r}; the roles are "
                             f"{', '.join(TARGET_ROLES)}")
    conversations = split_conversations(messages)
    for k, conversation in enumerate(conversations):
        if not any(m["role"].lower() == "assistant" for m in conversation):
            which = f"conversation {k + 1} of {len(conversations)} (a new one starts at each system message)" \
                if len(conversations) > 1 else "the conversation"
            raise ValueError(f"{where}: {which} has no assistant message, so nothing to train on")
    return conversations


class ConversationFile:
    """The checked lines of one jsonl file (Megatron's low-level SFT dataset): ``len`` lines, line ``j``
    its conversations. Only the lines' places in the file are kept."""

    def __init__(self, path: str, flag: str = "--data-path"):
        self.path = path
        self.flag = flag
        linenos, offsets, lengths = [], [], []
        for lineno, offset, length, obj in iter_jsonl_at(path, flag):
            check_line(obj, f"{flag} {path}:{lineno}")
            linenos.append(lineno)
            offsets.append(offset)
            lengths.append(length)
        if not linenos:
            raise ValueError(f"{flag} {path}: no conversations (the file is empty)")
        self.linenos = np.asarray(linenos, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.file_size = os.path.getsize(path)
        self._file: Any = None
        self._file_pid = -1

    def __len__(self) -> int:
        return len(self.linenos)

    def where(self, j: int) -> str:
        return f"{self.flag} {self.path}:{int(self.linenos[j])}"

    def __getitem__(self, j: int) -> list[list[dict[str, Any]]]:
        if self._file is None or self._file_pid != os.getpid():  # one handle per (loader worker) process
            self._file, self._file_pid = open(self.path, "rb"), os.getpid()
        self._file.seek(int(self.offsets[j]))
        raw = self._file.read(int(self.lengths[j]))
        return check_line(parse_jsonl_line(raw, self.where(j)), self.where(j))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None, "_file_pid": -1}


def pack_conversations(tokenized: Sequence[tuple[np.ndarray, np.ndarray]], seq_length: int, pad: int
                       ) -> tuple[dict[str, np.ndarray], int]:
    """One sample from the (tokens, targets) of a line's conversations (Megatron's packing, module
    docstring), and how many of the conversations it holds (fewer when it was cut)."""
    capacity = seq_length + 1
    tokens: list[int] = []
    targets: list[int] = []
    bounds = [0]  # Megatron's cu_seqlens
    used = 0
    for conv_tokens, conv_targets in tokenized:
        tokens.extend(conv_tokens.tolist())
        targets.extend(conv_targets.tolist())
        bounds.append(len(tokens))
        used += 1
        if len(tokens) >= capacity:
            tokens = tokens[:seq_length] + [pad]
            targets = targets[:seq_length] + [pad]
            bounds[-1] = seq_length
            break
    if len(tokens) < capacity:
        fill = capacity - len(tokens)
        tokens.extend([pad] * fill)
        targets.extend([pad] * fill)
        bounds[-1] = seq_length  # the padding belongs to the last conversation
    targets_arr = np.asarray(targets, dtype=np.int64)
    segments = np.empty(capacity, dtype=np.int64)
    for k in range(len(bounds) - 1):
        segments[bounds[k]:bounds[k + 1]] = k + 1
    segments[seq_length] = len(bounds) - 1  # the last label's place: never an input
    sample = {"tokens": np.asarray(tokens, dtype=np.int64),
              "targets": ((targets_arr != pad) & (targets_arr != IGNORE_INDEX)).astype(np.int64),
              "segments": segments}
    return sample, used


class SFTConversationDataset:
    """The samples of one file's split (Megatron's ``SFTDataset``): ``num_samples`` (None: one per
    line) packed samples, sample ``i`` from line ``indices[i % len(indices)]``."""

    def __init__(self, low: ConversationFile, path: str, indices: np.ndarray, num_samples: int | None,
                 split_name: str, tokenizer: Any, seq_length: int):
        if not hasattr(tokenizer, "tokenize_conversations"):
            raise ValueError("--sft needs --tokenizer-type SFTTokenizer (its --sft-tokenizer-prompt-format renders "
                             "the conversations)")
        self.low, self.path, self.indices = low, path, np.asarray(indices, dtype=np.int64)
        self.num_samples = len(self.indices) if num_samples is None else int(num_samples)
        self.split_name, self.tokenizer, self.seq_length = split_name, tokenizer, int(seq_length)
        self.pad = int(tokenizer.pad)
        # What a blend of several files describes itself by (its cache key).
        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict(
            [("class", "SFTDataset"), ("dataset_path", path), ("num_samples", self.num_samples),
             ("index_split", split_name), ("sequence_length", self.seq_length),
             ("prompt_format", tokenizer.prompt_format.name),
             ("lines", [int(self.indices[0]), int(self.indices[-1]) + 1]), ("file_size", low.file_size)])
        self._check_lines()

    def _tokenize(self, lines: Sequence[int], conversations: Sequence[list[list[dict[str, Any]]]]
                  ) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """The (tokens, targets) of each conversation of each line (``conversations[k]``: line ``lines[k]``'s),
        tokenized together; a conversation the format cannot tokenize is a ValueError naming its line."""
        flat = [c for line in conversations for c in line]
        try:
            tokenized = self.tokenizer.tokenize_conversations(flat)
        except ConversationError as e:
            k, first = 0, 0
            while first + len(conversations[k]) <= e.index:
                first += len(conversations[k])
                k += 1
            count = len(conversations[k])
            which = f"conversation {e.index - first + 1} of {count}: " if count > 1 else ""
            raise ValueError(f"{self.low.where(lines[k])}: {which}{e}") from None
        out, first = [], 0
        for line in conversations:
            out.append(tokenized[first:first + len(line)])
            first += len(line)
        return out

    def _check_lines(self) -> None:
        """Tokenize every line once: a line the prompt format cannot tokenize stops the run here, and
        the lines longer than a sample are counted (a warning)."""
        cut = dropped = 0
        for lo in range(0, len(self.indices), _CHECK_CHUNK):
            lines = self.indices[lo:lo + _CHECK_CHUNK].tolist()
            conversations = [self.low[j] for j in lines]
            for line, tokenized in zip(conversations, self._tokenize(lines, conversations)):
                if sum(len(tokens) for tokens, _ in tokenized) >= self.seq_length + 1:
                    cut += 1
                    _, used = pack_conversations(tokenized, self.seq_length, self.pad)
                    dropped += len(line) - used
        if cut:
            warnings.warn(f"{self.path} ({self.split_name}): {cut} of {len(self.indices)} lines have --seq-length + 1 "
                          f"({self.seq_length + 1}) tokens or more and are cut"
                          + (f"; {dropped} conversations after the cut are dropped" if dropped else ""),
                          stacklevel=2)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        j = int(self.indices[int(i) % len(self.indices)])
        (tokenized,) = self._tokenize([j], [self.low[j]])
        sample, _ = pack_conversations(tokenized, self.seq_length, self.pad)
        return sample


def build_conversation_datasets(cfg: DataConfig, tokenizer: Any, seq_length: int,
                                num_samples: Sequence[int | None]
                                ) -> tuple[SFTConversationDataset | None, ...]:
    """``(train, valid, test)`` of ``--sft`` jsonl files, by Megatron's split and blend rules."""
    if cfg.mock_data:
        raise ValueError("--sft reads jsonl conversations: give --data-path FILE.jsonl, not --mock-data")

    def make(low, path, indices, samples, split_index, split_str, matrix):
        return SFTConversationDataset(low, path, indices, samples, SPLIT_NAMES[split_index], tokenizer, seq_length)

    return build_split_datasets(cfg, num_samples, make, numel=len, open_dataset=ConversationFile)
