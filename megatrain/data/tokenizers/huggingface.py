"""Hugging Face ``tokenizer.json`` files (``--tokenizer-type HuggingFaceTokenizer``), read with the
fast ``tokenizers`` library (no ``transformers``): the file or folder, its special tokens and its
chat template, as ``transformers.AutoTokenizer.from_pretrained(folder)`` (version 5) reads them.

What is read beside ``tokenizer.json``, and how:

- ``tokenizer_config.json``: the named special tokens (``bos_token``, ``eos_token``, ``unk_token``,
  ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token``, model-specific ``*_token`` entries) and
  ``extra_special_tokens`` (``additional_special_tokens`` in older files). ``special_tokens_map.json``
  fills them in only for a config without ``added_tokens_decoder`` (an old or hand-written one), as
  transformers does. A named token the file's vocabulary lacks is appended (the next free id), and
  every named token becomes a special added token (never split), as transformers makes them.
- BOS/EOS around a text come from ``tokenizer.json``'s post-processor. transformers 5 ignores
  ``add_bos_token`` / ``add_eos_token`` of ``tokenizer_config.json`` whenever a ``tokenizer.json`` is
  there, and so does megatrain (transformers 4's ``LlamaTokenizerFast`` applied them: a folder whose
  flags disagree with its post-processor tokenizes differently there).
- The chat template: ``chat_template.jinja`` (and ``additional_chat_templates/NAME.jinja``), else the
  ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}``),
  else the ``chat_template`` of a processor's ``chat_template.json`` (which ``AutoTokenizer`` itself
  does not read). It is rendered in jinja2's sandbox (:mod:`.chat_template`).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from megatrain.data.tokenizers.base import MegatrainTokenizer, TokenizerConfig, need_path
from megatrain.data.tokenizers.chat_template import (ChatTemplateError, ChatTemplateRefused, assistant_spans,
                                                     compile_chat_template, render_chat)
from megatrain.json_input import parse_json

__all__ = ["HuggingFaceTokenizer", "build_huggingface", "CHAT_TEMPLATE_FILES", "NAMED_SPECIAL_TOKENS"]

_EOS_GUESSES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
_BOS_GUESSES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]")
_PAD_GUESSES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")

#: transformers' named special tokens, in its order (the order missing ones are appended in).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: Files of a tokenizer folder that hold chat templates (``additional_chat_templates/`` is a folder).
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# A model folder's generation defaults; its eos_token_id (one id or a list: a chat model's end-of-turn
# ids beside the end of text) is where generation stops.
GENERATION_CONFIG = "generation_config.json"


def _content(value: Any) -> str | None:
    """A special token as a string (configs hold strings or serialized AddedTokens)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--tokenizer-model: cannot read {what} {path} ({e})") from None


class HuggingFaceTokenizer(MegatrainTokenizer):
    """A Hugging Face ``tokenizer.json`` (fast ``tokenizers`` library, no ``transformers``).

    ``tokenize`` applies the file's post-processor (e.g. a BOS token), as ``AutoTokenizer``'s
    ``encode`` does; ``encode(text, add_special_tokens=False)`` does not. ``apply_chat_template``
    gives the ids ``AutoTokenizer``'s ``apply_chat_template(messages, tokenize=True)`` gives.
    """

    name = "HuggingFaceTokenizer"

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        if os.path.isdir(path):
            folder, file = path, os.path.join(path, "tokenizer.json")
            if not os.path.isfile(file):
                raise ValueError(f"--tokenizer-model {path}: folder has no tokenizer.json")
        else:
            folder, file = os.path.dirname(path), path
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # the library raises plain Exception subclasses
            raise ValueError(f"--tokenizer-model {file}: not a valid tokenizer.json ({e})") from None
        self.path = file
        self.folder = folder
        self.config = self._read_json(os.path.join(folder, "tokenizer_config.json"))
        self._named, self._extra = self._special_token_names(folder, self.config)
        self._add_special_tokens()
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        self._inv_vocab: dict[int, str] | None = None
        self._eod = self._special_id(self._named.get("eos_token"), _EOS_GUESSES)
        self._bos = self._special_id(self._named.get("bos_token"), _BOS_GUESSES)
        self._pad = self._special_id(self._named.get("pad_token"), _PAD_GUESSES)
        self.chat_templates, self.chat_template_source = self._find_chat_templates(folder, self.config)
        self._end_ids = self._generation_end_ids(os.path.join(folder, GENERATION_CONFIG))

    # ---- files ---------------------------------------------------------------------------------
    @staticmethod
    def _read_json(path: str) -> dict[str, Any]:
        if not os.path.isfile(path):
            return {}
        try:
            with open(path, "rb") as f:
                data = parse_json(f.read())
        except (OSError, ValueError) as e:
            raise ValueError(f"--tokenizer-model: cannot read {path} ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"--tokenizer-model: {path} must hold a JSON object, not {type(data).__name__}")
        return data

    @classmethod
    def _special_token_names(cls, folder: str, config: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
        """transformers' named special tokens (standard ones, then model-specific ``*_token``) and
        its extra special tokens."""
        values = dict(config)
        if "added_tokens_decoder" not in config:  # legacy: special_tokens_map.json fills the config in
            values.update(cls._read_json(os.path.join(folder, "special_tokens_map.json")))
        extra_value = values.get("extra_special_tokens", values.get("additional_special_tokens"))
        named: dict[str, str] = {}
        for key in NAMED_SPECIAL_TOKENS:
            if _content(values.get(key)) is not None:
                named[key] = _content(values[key])  # type: ignore[assignment]
        for key, value in config.items():  # model-specific names: the config's own string entries
            if key.endswith("_token") and key not in NAMED_SPECIAL_TOKENS and isinstance(value, str) and value:
                named[key] = value
        if isinstance(extra_value, dict):  # named extra tokens are model-specific named tokens
            named.update({k: _content(v) for k, v in extra_value.items() if _content(v) is not None})
            extra_value = []
        extra = [_content(v) for v in extra_value or [] if _content(v) is not None] \
            if isinstance(extra_value, list) else []
        return named, extra  # type: ignore[return-value]

    def _add_special_tokens(self) -> None:
        """Append the config's tokens the file lacks and mark the named ones special, as transformers
        does when it loads the folder (so that their ids, and the texts they split, are the same)."""
        from tokenizers import AddedToken

        added = {t.content: t for t in self._tok.get_added_tokens_decoder().values()}
        pending: list[Any] = []
        decoder = self.config.get("added_tokens_decoder")
        if isinstance(decoder, dict):
            def key(item: tuple[Any, Any]) -> int:
                try:
                    return int(item[0])
                except (TypeError, ValueError):
                    return 1 << 62
            for _, token in sorted(decoder.items(), key=key):
                content = _content(token)
                if content is not None and content not in added:
                    options = {k: bool(token[k]) for k in ("lstrip", "rstrip", "normalized", "single_word", "special")
                               if isinstance(token, dict) and k in token}
                    pending.append(AddedToken(content, **options))
        names = [*self._named.values(), *self._extra]
        for content in dict.fromkeys(names):
            if content in added and added[content].special:
                continue
            if all(getattr(t, "content", None) != content for t in pending):
                pending.append(AddedToken(content, special=True, normalized=False))
        for token in pending:
            if token.special:
                self._tok.add_special_tokens([token])
            else:
                self._tok.add_tokens([token])

    @staticmethod
    def _find_chat_templates(folder: str, config: dict[str, Any]) -> tuple[dict[str, str], str | None]:
        """{name: template} (``"default"`` the plain one) and the file it came from."""
        templates: dict[str, str] = {}
        source = None
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja):
            templates["default"] = _read_text(jinja, "the chat template")
            source = jinja
        extra_dir = os.path.join(folder, CHAT_TEMPLATE_DIR)
        if os.path.isdir(extra_dir):
            for name in sorted(os.listdir(extra_dir)):
                if name.endswith(".jinja") and os.path.isfile(os.path.join(extra_dir, name)):
                    templates[name[:-len(".jinja")]] = _read_text(os.path.join(extra_dir, name), "the chat template")
                    source = source or extra_dir
        if templates:
            return templates, source
        where = os.path.join(folder, "tokenizer_config.json")
        value = config.get("chat_template")
        if value is None:
            legacy = os.path.join(folder, "chat_template.json")
            if os.path.isfile(legacy):
                value, where = HuggingFaceTokenizer._read_json(legacy).get("chat_template"), legacy
        if value is None:
            return {}, None
        if isinstance(value, str):
            return {"default": value}, where
        if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                           and isinstance(t.get("template"), str) for t in value):
            return {t["name"]: t["template"] for t in value}, where
        raise ValueError(f"--tokenizer-model: {where}: \"chat_template\" must be a string or a list of "
                         "{\"name\": ..., \"template\": ...} objects")

    def _special_id(self, name: str | None, guesses: Sequence[str]) -> int | None:
        if name is not None and name in self._vocab:
            return self._vocab[name]
        for g in guesses:
            if g in self._vocab:
                return self._vocab[g]
        return None

    def _generation_end_ids(self, path: str) -> list[int]:
        """eos_token_id of generation_config.json (an id or a list of ids), each within the vocabulary."""
        value = self._read_json(path).get("eos_token_id")
        ids = value if isinstance(value, list) else [value] if value is not None else []
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size:
                raise ValueError(f"{path}: eos_token_id {value!r} is not a token id (or a list of them) of the "
                                 f"{self.vocab_size}-token vocabulary")
        return ids

    # ---- the tokenizer interface ---------------------------------------------------------------
    @property
    def end_ids(self) -> list[int]:
        """Ids that end a generation: eod, then the folder's generation_config.json eos ids."""
        head = [self._eod] if self._eod is not None else []
        return head + [i for i in self._end_ids if i not in head]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int | None:
        return self._eod

    @property
    def bos(self) -> int | None:
        return self._bos

    @property
    def pad(self) -> int | None:
        return self._pad

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        if self._inv_vocab is None:
            self._inv_vocab = {i: t for t, i in self._vocab.items()}
        return self._inv_vocab

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens the folder's config gives (what a chat template sees as
        ``bos_token``, ``eos_token``, ...): no guesses."""
        return dict(self._named)

    @property
    def extra_special_tokens(self) -> list[str]:
        return list(self._extra)

    def special_token_id(self, name: str) -> int | None:
        """The id of the config's ``name`` (``"eos_token"``...), None when it names none."""
        token = self._named.get(name)
        return None if token is None else self._vocab.get(token)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``tokenize``; ``add_special_tokens=False`` leaves out what the post-processor adds (BOS/EOS)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def batch_tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    # ---- chat ----------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        """The default chat template (None when the folder has none, or only named ones)."""
        return self.chat_templates.get("default")

    def get_chat_template(self, tools: Any = None) -> str:
        """The template ``apply_chat_template`` uses: ``tool_use`` when tools are given and there is
        one, else ``default``; ValueError when there is none."""
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            raise ValueError(f"--tokenizer-model {self.folder}: its chat templates are named "
                             f"{sorted(self.chat_templates)}, none \"default\"")
        raise ValueError(f"--tokenizer-model {self.folder}: the tokenizer has no chat template "
                         "(no chat_template.jinja, no \"chat_template\" in tokenizer_config.json)")

    def _where(self) -> str:
        return self.chat_template_source or self.folder

    def check_chat_templates(self) -> list[str]:
        """Compile every chat template and render a short conversation with each, in the sandbox.

        A syntax error, or a template the sandbox refuses (one that reaches for Python internals),
        raises :class:`ChatTemplateError`; a template that fails on the sample conversation (some
        refuse a system message, or want tools) gives a warning line, returned.
        """
        probe = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi."},
                 {"role": "assistant", "content": "Hello."}]
        warnings_: list[str] = []
        for name, source in self.chat_templates.items():
            where = f"{self._where()} ({name})" if len(self.chat_templates) > 1 else self._where()
            compile_chat_template(source, where)
            for messages, prompt in ((probe, False), (probe[1:2], True)):
                try:
                    render_chat(source, messages, add_generation_prompt=prompt, special_tokens=self._named,
                                where=where)
                except ChatTemplateRefused:
                    raise
                except ChatTemplateError as e:
                    warnings_.append(str(e))
                    break
        return warnings_

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
                    tools: Any = None, documents: Any = None, **kwargs: Any) -> str:
        """The conversation's text (``apply_chat_template(..., tokenize=False)``)."""
        return render_chat(self.get_chat_template(tools), messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self._named, tools=tools, documents=documents, where=self._where(),
                           **kwargs)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
                            tools: Any = None, documents: Any = None, **kwargs: Any) -> list[int]:
        """The conversation's ids: the rendered text encoded without the post-processor's tokens
        (the template writes BOS itself), as transformers does."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools, documents, **kwargs),
                           add_special_tokens=False)

    def chat_with_targets(self, messages: Sequence[Mapping[str, Any]],
                          **kwargs: Any) -> tuple[list[int], list[bool]]:
        """The conversation's ids (``apply_chat_template(messages)``) and, per token, whether the
        assistant wrote it (a token overlapping an assistant span of :func:`assistant_spans`)."""
        text, spans = assistant_spans(self.get_chat_template(kwargs.get("tools")), messages,
                                      special_tokens=self._named, where=self._where(), **kwargs)
        encoding = self._tok.encode(text, add_special_tokens=False)
        targets = []
        k = 0
        for start, end in encoding.offsets:
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            targets.append(k < len(spans) and end > spans[k][0] and end > start)
        return list(encoding.ids), targets


def build_huggingface(cfg: TokenizerConfig) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(need_path(cfg.tokenizer_model, "--tokenizer-model", "HuggingFaceTokenizer"))


__all__ += ["ChatTemplateError", "ChatTemplateRefused"]
