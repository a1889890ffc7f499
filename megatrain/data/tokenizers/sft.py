"""Megatron-LM's ``SFTTokenizer`` (``--tokenizer-type SFTTokenizer``): a Hugging Face ``tokenizer.json``
(``--tokenizer-model``) that renders chat conversations in a prompt format
(``--sft-tokenizer-prompt-format``) and marks which tokens are trained on.

The formats are Megatron's custom chat templates (``megatron/core/tokenizers/text/libraries/
sft_tokenizer.py``), written out here as Python; each renders every message on its own and the
conversation is their concatenation:

``nemotron-h-aligned`` (Megatron's default)
    system ``<SPECIAL_10>System\\n{content.strip()}\\n``; user ``<SPECIAL_11>User\\n{content.strip()}\\n``
    followed by ``<SPECIAL_11>Assistant\\n``; assistant ``{content.strip()}\\n``; other roles nothing.
    Pads with ``<SPECIAL_233>``.
``nemotron-nano-v2``
    system ``<SPECIAL_10>System\\n{c}\\n`` and user ``<SPECIAL_11>User\\n{c}\\n`` where ``c`` is the
    content without ``/think`` and ``/no_think``, stripped; assistant
    ``<SPECIAL_11>Assistant\\n{content.strip()}\\n<SPECIAL_12>\\n``, whose first 3 tokens (the
    assistant header) carry no loss; other roles nothing. Pads with ``<unk>``.
``identity``
    every message's content as it is, concatenated. Pads with ``<unk>``.
``default``
    the tokenizer folder's own chat template (``chat_template.jinja`` or ``tokenizer_config.json``'s
    ``chat_template``, rendered as transformers' ``apply_chat_template`` renders it:
    :meth:`HuggingFaceTokenizer.apply_chat_template`), and every token is a target (Megatron does not
    mask this format). Pads with the tokenizer's ``pad_token``, else its ``eos_token``.

A pad token the vocabulary lacks falls back to the tokenizer's ``unk_token``, as transformers'
``convert_tokens_to_ids`` does.

:meth:`SFTTokenizer.tokenize_conversation` is Megatron's: the whole conversation is tokenized at
once (no special tokens added: the template is the whole text, as transformers'
``apply_chat_template`` tokenizes it); then each message alone, whose tokens must be the next ones of
the conversation's. System, user and tool messages get the target :data:`IGNORE_INDEX`; an assistant
message keeps its tokens as targets, except the format's assistant header. The role is compared in
lower case for the targets, exactly (case and all) by the templates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from megatrain.data.tokenizers.base import TokenizerConfig, need_path
from megatrain.data.tokenizers.huggingface import HuggingFaceTokenizer

__all__ = ["IGNORE_INDEX", "ConversationError", "PROMPT_FORMATS", "DEFAULT_PROMPT_FORMAT", "PromptFormat",
           "SFTTokenizer", "build_sft", "check_prompt_format"]

#: The target of a token that carries no loss (Megatron's ``IGNORE_INDEX``).
IGNORE_INDEX = -100

#: Megatron's default ``--sft-tokenizer-prompt-format``.
DEFAULT_PROMPT_FORMAT = "nemotron-h-aligned"

#: The roles Megatron's target masking knows (compared in lower case).
TARGET_ROLES = ("system", "user", "tool", "assistant")


def _strip_thinking(text: str) -> str:
    return text.replace("/think", "").replace("/no_think", "").strip()


def _nemotron_h_aligned(message: Mapping[str, Any]) -> str:
    role, content = message["role"], message["content"]
    if role == "system":
        return "<SPECIAL_10>System\n" + content.strip() + "\n"
    if role == "user":
        return "<SPECIAL_11>User\n" + content.strip() + "\n" + "<SPECIAL_11>Assistant\n"
    if role == "assistant":
        return content.strip() + "\n"
    return ""


def _nemotron_nano_v2(message: Mapping[str, Any]) -> str:
    role, content = message["role"], message["content"]
    if role == "system":
        return "<SPECIAL_10>System\n" + _strip_thinking(content) + "\n"
    if role == "user":
        return "<SPECIAL_11>User\n" + _strip_thinking(content) + "\n"
    if role == "assistant":
        return "<SPECIAL_11>Assistant\n" + content.strip() + "\n<SPECIAL_12>\n"
    return ""


def _identity(message: Mapping[str, Any]) -> str:
    return message["content"]


@dataclass(frozen=True)
class PromptFormat:
    """One ``--sft-tokenizer-prompt-format``: how a message renders (None: the tokenizer's own chat
    template renders the conversation, and nothing is masked), the token that pads (None: the
    tokenizer's pad token, else its eos token), and how many tokens of an assistant message's
    rendering are its header (no loss)."""

    name: str
    render_message: Optional[Callable[[Mapping[str, Any]], str]]
    pad_token: Optional[str]
    assistant_prefix_len: int = 0

    def render(self, conversation: Sequence[Mapping[str, Any]]) -> str:
        assert self.render_message is not None, "the default format renders with the tokenizer's template"
        return "".join(self.render_message(m) for m in conversation)


PROMPT_FORMATS: dict[str, PromptFormat] = {
    "nemotron-h-aligned": PromptFormat("nemotron-h-aligned", _nemotron_h_aligned, "<SPECIAL_233>"),
    "nemotron-nano-v2": PromptFormat("nemotron-nano-v2", _nemotron_nano_v2, "<unk>", assistant_prefix_len=3),
    "identity": PromptFormat("identity", _identity, "<unk>"),
    "default": PromptFormat("default", None, None),
}


def check_prompt_format(name: str | None) -> PromptFormat:
    """The format named by ``--sft-tokenizer-prompt-format``; any other name is a one-line ValueError."""
    name = DEFAULT_PROMPT_FORMAT if name is None else name
    if name in PROMPT_FORMATS:
        return PROMPT_FORMATS[name]
    raise ValueError(f"--sft-tokenizer-prompt-format {name!r} is not a prompt format of Megatron's SFTTokenizer; "
                     f"supported: {', '.join(PROMPT_FORMATS)}")


class ConversationError(ValueError):
    """A conversation the prompt format cannot turn into tokens and targets (one line); ``index``: which
    of the conversations tokenized together."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


class SFTTokenizer(HuggingFaceTokenizer):
    """A ``tokenizer.json`` with a prompt format: plain text as :class:`HuggingFaceTokenizer`, and
    conversations as tokens and targets (:meth:`tokenize_conversation`). ``pad`` is the format's pad
    token; ``eod`` the tokenizer's end-of-sequence token."""

    name = "SFTTokenizer"

    def __init__(self, path: str, prompt_format: str | None = None):
        super().__init__(path)
        self.prompt_format = check_prompt_format(prompt_format)
        fmt = self.prompt_format
        if fmt.render_message is None and self.chat_template is None:
            raise ValueError(f"--sft-tokenizer-prompt-format {fmt.name} renders conversations with the tokenizer's "
                             f"own chat template, which --tokenizer-model {path} does not have (no "
                             "chat_template.jinja, no \"chat_template\" in tokenizer_config.json)")
        if fmt.pad_token is not None:
            pad = self.vocab.get(fmt.pad_token, self.special_token_id("unk_token"))  # convert_tokens_to_ids
            missing = f"pads with {fmt.pad_token}, which the tokenizer has neither as a token nor as its unk_token"
        else:
            pad = self.special_token_id("pad_token")
            pad = self.special_token_id("eos_token") if pad is None else pad
            missing = "pads with the tokenizer's pad_token, else its eos_token, and it names neither"
        if pad is None:
            raise ValueError(f"--sft-tokenizer-prompt-format {fmt.name} {missing} (--tokenizer-model {path})")
        self._pad_id = int(pad)

    @property
    def pad(self) -> int:
        return self._pad_id

    def _encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def tokenize_conversation(self, conversation: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and targets (int64; :data:`IGNORE_INDEX` where there is no loss) of one conversation."""
        return self.tokenize_conversations([conversation])[0]

    def tokenize_conversations(self, conversations: Sequence[Sequence[Mapping[str, Any]]]
                               ) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`tokenize_conversation` of each (tokenized together, faster). A conversation the format
        cannot give targets raises :class:`ConversationError` naming its index and the reason."""
        fmt = self.prompt_format
        if fmt.render_message is None:  # the tokenizer's template; Megatron trains on every token
            out = []
            for k, conversation in enumerate(conversations):
                try:
                    tokens = np.asarray(self.apply_chat_template(conversation), dtype=np.int64)
                except ValueError as e:
                    raise ConversationError(str(e), index=k) from None
                out.append((tokens, tokens.copy()))
            return out
        texts = []
        for conversation in conversations:
            texts.append(fmt.render(conversation))
            texts.extend(fmt.render_message(m) for m in conversation)
        encoded = iter(self._encode_many(texts))
        out = []
        for k, conversation in enumerate(conversations):
            tokens = np.asarray(next(encoded), dtype=np.int64)
            turns = [next(encoded) for _ in conversation]
            try:
                out.append((tokens, self._targets(conversation, tokens, turns)))
            except ConversationError as e:
                raise ConversationError(str(e), index=k) from None
        return out

    def _targets(self, conversation: Sequence[Mapping[str, Any]], tokens: np.ndarray,
                 turns: Sequence[list[int]]) -> np.ndarray:
        """Megatron's target masking: each message's own tokens must be the conversation's next ones."""
        fmt = self.prompt_format
        targets = tokens.copy()
        start = 0
        for i, (message, turn) in enumerate(zip(conversation, turns)):
            role = message["role"].lower()
            if role == "assistant" and not message["content"]:
                raise ConversationError(f"message {i} is an empty assistant message")
            # Megatron's check, as written: the message before (for the first, the last one) is the user's
            # or a tool's.
            if role == "assistant" and conversation[i - 1]["role"].lower() not in ("user", "tool"):
                raise ConversationError(f"message {i} (assistant) does not follow a user or tool message")
            end = start + len(turn)
            if role in ("system", "user", "tool"):
                targets[start:end] = IGNORE_INDEX
            elif role == "assistant":
                targets[start:start + fmt.assistant_prefix_len] = IGNORE_INDEX
            else:
                raise ConversationError(f"message {i} has role {message['role']!r}; the roles are "
                                        f"{', '.join(TARGET_ROLES)}")
            if tokens[start:end].tolist() != turn:
                raise ConversationError(
                    f"message {i} ({message['role']}) does not tokenize on its own as it does inside its "
                    f"conversation under --sft-tokenizer-prompt-format {fmt.name}, so the loss cannot be placed "
                    "on the assistant's tokens (the texts of neighbouring messages merge into shared tokens)")
            start = end
        if start != len(tokens):
            raise ConversationError(f"its messages' tokens ({start}) do not add up to the conversation's "
                                    f"({len(tokens)}) under --sft-tokenizer-prompt-format {fmt.name}")
        return targets


def build_sft(cfg: TokenizerConfig) -> SFTTokenizer:
    return SFTTokenizer(need_path(cfg.tokenizer_model, "--tokenizer-model", "SFTTokenizer"),
                        cfg.sft_tokenizer_prompt_format)
