"""LLaVA conversations as tokens: the ``<image>`` placeholder becomes image token ids, the loss covers
the answers only.

A LLaVA conversation is a list of ``{"from": "human" | "gpt" | "system", "value": str}`` turns
(``user`` and ``assistant`` are accepted as the same roles). It becomes megatrain's chat messages
(``{"role": "system" | "user" | "assistant", "content": ...}``) and is tokenized by the SFT path of
the tokenizer in use, unchanged:

* an ``SFTTokenizer`` (``--sft``): its prompt format
  (:meth:`megatrain.data.tokenizers.sft.SFTTokenizer.tokenize_conversation`), the targets on the
  assistant's tokens;
* any other tokenizer: :func:`megatrain.data.sft_dataset.tokenize_example`: a Hugging Face tokenizer's
  own chat template when its folder has one, else megatrain's ``<|role|>`` template with EOD, the
  targets on the assistant's content.

The placeholder: when the tokenizer has ``<image>`` as one token (a Hugging Face LLaVA tokenizer's
added token), the conversation is tokenized with it in place and each of its ids marks an image
("native" mode). Otherwise (a BPE without that token) the text around each ``<image>`` is tokenized
on its own and the image id put between the pieces ("split" mode, LLaVA's ``tokenizer_image_token``);
that works for megatrain's template only, since a prompt format or chat template tokenizes the whole
conversation at once. Each placeholder then becomes ``num_image_tokens`` copies of ``image_token_id``
(1: the model expands it into the vision tower's patches; the patch count: the dataset pre-expands),
none of them a target.

:class:`ConversationEncoder` does this for one sample and cuts it to ``seq_length + 1`` tokens; an
image whose tokens would be cut is an error (kind ``length``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from megatrain.data.multimodal.errors import MultimodalDataError
from megatrain.data.sft_dataset import SFTConfig, tokenize_example
from megatrain.data.tokenizers.sft import IGNORE_INDEX, ConversationError

__all__ = ["IMAGE_PLACEHOLDER", "ROLES", "ConversationEncoder", "EncodedConversation", "check_placeholders",
           "to_messages"]

#: The image placeholder of LLaVA's data.
IMAGE_PLACEHOLDER = "<image>"

#: LLaVA's speaker names (and megatrain's) -> chat roles.
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def to_messages(conversations: Any, where: str) -> list[dict[str, str]]:
    """Chat messages of a LLaVA ``conversations`` list; a malformed one raises :class:`MultimodalDataError`."""
    if not isinstance(conversations, list) or not conversations:
        raise MultimodalDataError("\"conversations\" must be a non-empty list of {\"from\", \"value\"} turns",
                                  where, "conversation")
    messages = []
    for i, turn in enumerate(conversations):
        if not (isinstance(turn, dict) and isinstance(turn.get("value"), str) and isinstance(turn.get("from"), str)):
            raise MultimodalDataError(f"turn {i} of \"conversations\" must be an object with string \"from\" and "
                                      "\"value\"", where, "conversation")
        role = ROLES.get(turn["from"].lower())
        if role is None:
            raise MultimodalDataError(f"turn {i} is from {turn['from']!r}; expected one of "
                                      f"{', '.join(sorted(ROLES))}", where, "conversation")
        messages.append({"role": role, "content": turn["value"]})
    if not any(m["role"] == "assistant" for m in messages):
        raise MultimodalDataError("the conversation has no \"gpt\" turn, so nothing to train on", where,
                                  "conversation")
    return messages


def check_placeholders(messages: list[dict[str, str]], num_images: int, where: str) -> int:
    """The number of ``<image>`` placeholders of ``messages`` (from :func:`to_messages`), which must be
    ``num_images`` and all in human (or system) turns; otherwise :class:`MultimodalDataError` (one line
    with both counts)."""
    placeholders = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if placeholders != num_images:
        if num_images == 1:
            msg = (f"has an image but {placeholders} {IMAGE_PLACEHOLDER} placeholders in its turns; "
                   f"put one {IMAGE_PLACEHOLDER} where the image goes (LLaVA: \"{IMAGE_PLACEHOLDER}\\n\" "
                   "at the start of the first human turn)")
        elif num_images:
            msg = (f"has {num_images} images but {placeholders} {IMAGE_PLACEHOLDER} placeholders in its turns; "
                   f"put one {IMAGE_PLACEHOLDER} per image, the i-th where the i-th image of \"image\" goes")
        else:
            msg = (f"has no \"image\" but {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) in its turns")
        raise MultimodalDataError(msg, where, "conversation")
    if any(IMAGE_PLACEHOLDER in m["content"] for m in messages if m["role"] == "assistant"):
        raise MultimodalDataError(f"a \"gpt\" turn holds {IMAGE_PLACEHOLDER}; images go in the human turns",
                                  where, "conversation")
    return placeholders


@dataclass
class EncodedConversation:
    """``tokens`` and ``targets`` (int64 [n]; ``targets[j]`` = 1: token j is predicted from token j - 1
    and counted in the loss, megatrain's SFT convention), and whether it was cut to fit."""

    tokens: np.ndarray
    targets: np.ndarray
    truncated: bool


class _ImageSplittingTokenizer:
    """A tokenizer whose ``tokenize`` puts ``marker`` for every ``<image>`` and tokenizes the text between
    on its own (split mode); everything else is the wrapped tokenizer's."""

    def __init__(self, inner: Any, marker: int):
        self._inner, self._marker = inner, marker
        self.name = f"image-splitting {getattr(inner, 'name', type(inner).__name__)}"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("chat_template", "chat_with_targets", "tokenize_conversations"):
            raise AttributeError(name)  # megatrain's template only
        return getattr(self._inner, name)

    def tokenize(self, text: str) -> list[int]:
        bos = getattr(self._inner, "bos", None)
        out: list[int] = []
        for k, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
            if k:
                out.append(self._marker)
            ids = self._inner.tokenize(piece) if piece else []
            if k and bos is not None and ids and ids[0] == bos:
                ids = ids[1:]  # BOS only at the very start
            out.extend(ids)
        return out


def _single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when the tokenizer has it as one token, else None."""
    try:
        ids = list(tokenizer.tokenize(text))
    except (ValueError, KeyError):
        return None
    bos = getattr(tokenizer, "bos", None)
    if ids and bos is not None and ids[0] == bos and len(ids) > 1:
        ids = ids[1:]
    if len(ids) != 1:
        return None
    try:
        vocab = tokenizer.vocab
    except (NotImplementedError, AttributeError):
        return int(ids[0])
    return int(ids[0]) if vocab.get(text) == ids[0] else None


class ConversationEncoder:
    """LLaVA conversations -> :class:`EncodedConversation` (module docstring).

    ``image_token_id``: the id image positions carry (default: the tokenizer's ``<image>`` id, which
    split mode lacks: give one, e.g. the first id after the vocabulary, which the model's embedding
    never looks up). ``num_image_tokens``: ids per image (1, or the vision tower's patch count to
    pre-expand). ``seq_length``: samples are at most ``seq_length + 1`` tokens.
    """

    def __init__(self, tokenizer: Any, seq_length: int, image_token_id: int | None = None,
                 num_image_tokens: int = 1):
        if isinstance(num_image_tokens, bool) or not isinstance(num_image_tokens, int) or num_image_tokens < 1:
            raise ValueError(f"num_image_tokens must be a positive int, got {num_image_tokens!r}")
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.tokenizer, self.seq_length, self.num_image_tokens = tokenizer, int(seq_length), num_image_tokens
        self.placeholder_id = _single_token_id(tokenizer, IMAGE_PLACEHOLDER)
        self.is_sft_tokenizer = hasattr(tokenizer, "tokenize_conversations")
        uses_template = getattr(tokenizer, "chat_template", None) is not None and not self.is_sft_tokenizer
        if self.placeholder_id is None:
            if self.is_sft_tokenizer or uses_template:
                how = ("its --sft-tokenizer-prompt-format" if self.is_sft_tokenizer else "its chat template")
                raise ValueError(f"{getattr(tokenizer, 'name', 'the tokenizer')} renders whole conversations with "
                                 f"{how}, so {IMAGE_PLACEHOLDER} must be one token of its vocabulary: add it as a "
                                 "special token (as LLaVA's tokenizers have it)")
            if image_token_id is None:
                raise ValueError(f"the tokenizer has no {IMAGE_PLACEHOLDER} token: give image_token_id (e.g. "
                                 f"{tokenizer.vocab_size}, the first id after the vocabulary)")
        self.image_token_id = int(self.placeholder_id if image_token_id is None else image_token_id)
        marker = self.placeholder_id if self.placeholder_id is not None else -1
        self._marker = marker
        self._tok = tokenizer if self.placeholder_id is not None else _ImageSplittingTokenizer(tokenizer, marker)
        self._sft_config = SFTConfig(seq_length=self.seq_length)

    @property
    def mode(self) -> str:
        return "native" if self.placeholder_id is not None else "split"

    def _tokenize(self, messages: list[dict[str, str]], where: str) -> tuple[np.ndarray, np.ndarray]:
        try:
            if self.is_sft_tokenizer:
                tokens, targets = self._tok.tokenize_conversation(messages)
                return np.asarray(tokens, dtype=np.int64), (np.asarray(targets) != IGNORE_INDEX).astype(np.int64)
            ex = tokenize_example({"messages": messages}, self._tok, self._sft_config)
        except (ConversationError, ValueError) as e:
            raise MultimodalDataError(f"cannot tokenize the conversation ({e})", where, "conversation") from None
        return np.asarray(ex.tokens, dtype=np.int64), np.asarray(ex.targets, dtype=np.int64)

    def encode(self, conversations: Any, num_images: int, where: str) -> EncodedConversation:
        """Tokens and targets of one sample with ``num_images`` images (the i-th ``<image>`` is image i)."""
        messages = to_messages(conversations, where)
        placeholders = check_placeholders(messages, num_images, where)
        tokens, targets = self._tokenize(messages, where)
        is_image = tokens == self._marker
        if int(is_image.sum()) != placeholders:
            raise MultimodalDataError(
                f"{placeholders} {IMAGE_PLACEHOLDER} placeholder(s) gave {int(is_image.sum())} image token(s) (the "
                f"text holds the {IMAGE_PLACEHOLDER} token's id some other way, or the template dropped it)",
                where, "conversation")
        targets = np.where(is_image, 0, targets)
        if self.num_image_tokens > 1 and placeholders:
            repeat = np.where(is_image, self.num_image_tokens, 1)
            tokens, targets, is_image = (np.repeat(tokens, repeat), np.repeat(targets, repeat),
                                         np.repeat(is_image, repeat))
        tokens = np.where(is_image, self.image_token_id, tokens)
        capacity = self.seq_length + 1
        truncated = len(tokens) > capacity
        if truncated:
            if is_image[capacity:].any():
                last = int(np.flatnonzero(is_image)[-1]) + 1
                which, before = ("image", "the image") if placeholders == 1 else ("last image", "the images")
                raise MultimodalDataError(
                    f"the {which}'s tokens end at token {last} but a sample holds seq_length + 1 = {capacity} tokens "
                    f"(the conversation has {len(tokens)}): raise seq_length or shorten the text before {before}",
                    where, "length")
            tokens, targets = tokens[:capacity], targets[:capacity]
        targets = targets.copy()
        if len(targets):
            targets[0] = 0  # the first token is never predicted
        return EncodedConversation(tokens.astype(np.int64), targets.astype(np.int64), truncated)

    def describe(self) -> dict[str, Any]:
        """What the samples depend on (for a cache key or a log line)."""
        return {"tokenizer": getattr(self.tokenizer, "name", type(self.tokenizer).__name__), "mode": self.mode,
                "image_token_id": self.image_token_id, "num_image_tokens": self.num_image_tokens,
                "seq_length": self.seq_length}

