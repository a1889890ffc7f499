"""Tokenizer files between megatrain's tokenizer flags and a Hugging Face model folder.

Export: the tokenizer a checkpoint was trained with (its ``--tokenizer-type`` and files) becomes the
files ``AutoTokenizer.from_pretrained`` reads: ``tokenizer.json`` (+ ``vocab.json``/``merges.txt``
for GPT-2 BPE), ``tokenizer.model`` for SentencePiece, or a WordPiece ``vocab.txt`` for BERT, plus
``tokenizer_config.json`` and ``special_tokens_map.json``. Import: the tokenizer files of a Hugging
Face folder are copied into the checkpoint and described with the matching megatrain flags.
A ``tokenizer.json`` tokenizer travels with its chat template files both ways (``chat_template.jinja``,
``additional_chat_templates/``, ``chat_template.json``; the template inside ``tokenizer_config.json``
travels with that file); the import refuses a template that does not compile or that the sandbox
refuses.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatrain.atomic_io import atomic_path, atomic_write_json
from megatrain.data.tokenizers import GPT2_EOD, HuggingFaceTokenizer, _load_gpt2_files, build_tokenizer
from megatrain.data.tokenizers.huggingface import CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILES, GENERATION_CONFIG
from megatrain.json_input import parse_json

WORDPIECE_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase")
# BERT's special tokens as Hugging Face's BertTokenizer names them.
_WORDPIECE_SPECIAL = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                      "mask_token": "[MASK]"}


@dataclass
class SpecialTokens:
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    files: list[str] = field(default_factory=list)


def atomic_copy(src: str, dst: str) -> None:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def _token_text(tokenizer: Any, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    try:
        return tokenizer.inv_vocab.get(token_id)
    except Exception:  # noqa: BLE001 - some tokenizer types have no inverse vocabulary
        return None


def open_tokenizer(tok_args: dict[str, Any]) -> Any | None:
    """megatrain's tokenizer for ``tok_args`` (a checkpoint's tokenizer flags); None, with a warning,
    when they name none or its files cannot be opened."""
    if tok_args.get("tokenizer_type") is None:
        warnings.warn("the checkpoint records no --tokenizer-type; no tokenizer files were written")
        return None
    try:
        return build_tokenizer(tok_args)
    except (ValueError, OSError) as e:
        warnings.warn(f"cannot open the checkpoint's tokenizer ({e}); no tokenizer files were written "
                      "(pass the tokenizer flags to point at its files)")
        return None


def write_hf_tokenizer(tok_args: dict[str, Any], out_dir: str, model_max_length: int, *,
                       tokenizer: Any | None = None, vocab_rows: int | None = None,
                       extra_config: Mapping[str, Any] | None = None) -> SpecialTokens:
    """Write the Hugging Face tokenizer files for the tokenizer ``tok_args`` describes.

    ``tokenizer``: the one :func:`open_tokenizer` gave (opened here when not given); ``vocab_rows``:
    the exported embedding's rows (a WordPiece ``vocab.txt`` leaves out the tokens megatrain appended
    beyond them); ``extra_config``: entries added to the tokenizer_config.json written. Returns the
    special ids for config.json; a tokenizer type without a Hugging Face form writes nothing and warns
    (the model files are still complete).
    """
    kind = tok_args.get("tokenizer_type")
    tokenizer = tokenizer if tokenizer is not None else open_tokenizer(tok_args)
    if tokenizer is None:
        return SpecialTokens()
    config: dict[str, Any] = {"model_max_length": model_max_length, "clean_up_tokenization_spaces": False}
    files: list[str] = []

    if kind == "GPT2BPETokenizer":
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

        vocab, merges = _load_gpt2_files(tok_args["vocab_file"], tok_args["merge_file"])
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(GPT2_EOD, special=True)])
        with atomic_path(os.path.join(out_dir, "tokenizer.json")) as tmp:
            tok.save(tmp)
        atomic_copy(tok_args["vocab_file"], os.path.join(out_dir, "vocab.json"))
        atomic_copy(tok_args["merge_file"], os.path.join(out_dir, "merges.txt"))
        files += ["tokenizer.json", "vocab.json", "merges.txt"]
        special = {"bos_token": GPT2_EOD, "eos_token": GPT2_EOD, "unk_token": GPT2_EOD}
        config.update(tokenizer_class="GPT2Tokenizer", add_prefix_space=False, add_bos_token=False, **special)
        ids = SpecialTokens(tokenizer.eod, tokenizer.eod, None)
    elif kind == "HuggingFaceTokenizer":
        src = tokenizer.path  # the tokenizer.json file
        atomic_copy(src, os.path.join(out_dir, "tokenizer.json"))
        files.append("tokenizer.json")
        folder = os.path.dirname(src)
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if os.path.isfile(os.path.join(folder, name)):
                atomic_copy(os.path.join(folder, name), os.path.join(out_dir, name))
                files.append(name)
        files += _copy_chat_templates(tokenizer, folder, out_dir)
        if os.path.isfile(os.path.join(folder, GENERATION_CONFIG)):  # its end ids (several for chat models)
            atomic_copy(os.path.join(folder, GENERATION_CONFIG), os.path.join(out_dir, GENERATION_CONFIG))
            files.append(GENERATION_CONFIG)
        special = {k: v for k, v in (("bos_token", _token_text(tokenizer, tokenizer.bos)),
                                     ("eos_token", _token_text(tokenizer, tokenizer.eod)),
                                     ("pad_token", _token_text(tokenizer, tokenizer.pad))) if v is not None}
        config.update(tokenizer_class="PreTrainedTokenizerFast", **special)
        ids = SpecialTokens(tokenizer.bos, tokenizer.eod, tokenizer.pad)
        if "tokenizer_config.json" in files:
            return SpecialTokens(ids.bos_token_id, ids.eos_token_id, ids.pad_token_id, files)
    elif kind in ("GPTSentencePieceTokenizer", "Llama2Tokenizer", "SentencePieceTokenizer"):
        atomic_copy(tok_args["tokenizer_model"], os.path.join(out_dir, "tokenizer.model"))
        files.append("tokenizer.model")
        special = {k: v for k, v in (("bos_token", _token_text(tokenizer, tokenizer.bos)),
                                     ("eos_token", _token_text(tokenizer, tokenizer.eod)),
                                     ("unk_token", "<unk>")) if v is not None}
        config.update(tokenizer_class="LlamaTokenizer", add_bos_token=kind == "Llama2Tokenizer",
                      add_eos_token=False, legacy=True, **special)
        ids = SpecialTokens(tokenizer.bos, tokenizer.eod, None)
    elif kind in WORDPIECE_TYPES:
        written = _write_wordpiece_vocab(tokenizer, os.path.join(out_dir, "vocab.txt"), vocab_rows)
        files.append("vocab.txt")
        special: dict[str, Any] = dict(_WORDPIECE_SPECIAL)
        # The --vocab-extra-ids sentinels (T5's) the file holds: special tokens, so that Hugging Face's
        # tokenizer gives a literal <extra_id_i> in a text its id.
        sentinels = [t for t in written if _appended_wordpiece_token(t)]
        if sentinels:
            special["additional_special_tokens"] = sentinels
        # strip_accents None: it follows do_lower_case, as megatrain's WordPiece does
        config.update(tokenizer_class="BertTokenizer", do_lower_case=kind == "BertWordPieceLowerCase",
                      strip_accents=None, tokenize_chinese_chars=True, **special)
        ids = SpecialTokens(None, None, tokenizer.pad)  # BERT has no BOS/EOS of its own ([CLS]/[SEP])
    else:
        warnings.warn(f"--tokenizer-type {kind} has no Hugging Face tokenizer form here; no tokenizer files "
                      "were written (copy your tokenizer beside the model yourself)")
        return SpecialTokens(getattr(tokenizer, "bos", None), tokenizer.eod, None)

    config.update(extra_config or {})
    atomic_write_json(os.path.join(out_dir, "tokenizer_config.json"), config, indent=2, sort_keys=True)
    atomic_write_json(os.path.join(out_dir, "special_tokens_map.json"), special, indent=2, sort_keys=True)
    files += ["tokenizer_config.json", "special_tokens_map.json"]
    return SpecialTokens(ids.bos_token_id, ids.eos_token_id, ids.pad_token_id, files)


def _appended_wordpiece_token(token: str) -> bool:
    """Tokens megatrain's WordPiece adds after a vocab.txt's own (the ``--vocab-extra-ids`` sentinels)."""
    return token.startswith("<extra_id_") and token.endswith(">")


def _write_wordpiece_vocab(tokenizer: Any, path: str, rows: int | None) -> list[str]:
    """``vocab.txt``: one token a line in megatrain's id order, so Hugging Face's line numbers are the
    same ids (megatrain skips blank and repeated lines of the source file; this file has none). Tokens
    megatrain appended beyond the exported ``rows`` are left out: the model has no row for them.
    Returns the tokens written."""
    tokens = [tokenizer.inv_vocab[i] for i in range(tokenizer.vocab_size)]
    while rows is not None and len(tokens) > rows and _appended_wordpiece_token(tokens[-1]):
        tokens.pop()
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(t + "\n" for t in tokens))
    return tokens


def _read_json(path: str) -> dict[str, Any]:
    """A folder's JSON side file as a dict ({} when missing or unreadable: it only refines defaults)."""
    try:
        with open(path, "rb") as f:
            value = parse_json(f.read())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


@dataclass
class _WordPiece:
    """A folder's BERT WordPiece tokenizer: whether it lowercases, and its tokens in id order when
    they have to be written as vocab.txt (None: the folder has its own vocab.txt)."""

    lower_case: bool
    tokens: list[str] | None


def _tokens_of_wordpiece_json(fast: dict[str, Any]) -> list[str] | None:
    """A WordPiece ``tokenizer.json``'s vocabulary in id order, when its ids are exactly 0..N-1."""
    vocab = (fast.get("model") or {}).get("vocab")
    if not isinstance(vocab, dict) or not vocab:
        return None
    by_id = {i: t for t, i in vocab.items() if isinstance(i, int)}
    if len(by_id) != len(vocab) or set(by_id) != set(range(len(vocab))):
        return None
    tokens = [by_id[i] for i in range(len(vocab))]
    if any(not t or "\n" in t or "\r" in t for t in tokens):
        return None  # a vocab.txt line could not hold it
    return tokens


def _find_wordpiece(hf_dir: str) -> _WordPiece | None:
    """The folder's BERT WordPiece tokenizer, or None when it has none.

    It has one when ``tokenizer_config.json`` names a BERT tokenizer class, or names none and the
    folder has a ``tokenizer.json`` of a WordPiece model with BERT's normalizer, or a ``vocab.txt``
    and no other tokenizer.
    The vocabulary is ``vocab.txt``, else the ``tokenizer.json``'s (transformers 5 saves only that).
    ``do_lower_case`` comes from ``tokenizer_config.json``, else from ``tokenizer.json``'s normalizer,
    else BertTokenizer's default (True).
    """
    config = _read_json(os.path.join(hf_dir, "tokenizer_config.json"))
    fast = _read_json(os.path.join(hf_dir, "tokenizer.json"))
    has_txt = os.path.isfile(os.path.join(hf_dir, "vocab.txt"))
    is_wordpiece_json = (fast.get("model") or {}).get("type") == "WordPiece"
    cls = config.get("tokenizer_class")
    if isinstance(cls, str) and cls:
        if not cls.startswith("BertTokenizer"):
            return None
    elif fast:  # no class named: a tokenizers WordPiece with BERT's normalizer
        if not is_wordpiece_json or (fast.get("normalizer") or {}).get("type") != "BertNormalizer":
            return None
    elif not has_txt or os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
        return None
    tokens = None
    if not has_txt:
        tokens = _tokens_of_wordpiece_json(fast) if is_wordpiece_json else None
        if tokens is None:
            return None
    normalizer = fast.get("normalizer") or {}
    lower = config.get("do_lower_case")
    if not isinstance(lower, bool):
        lower = normalizer.get("lowercase") if isinstance(normalizer.get("lowercase"), bool) else True
    strip = config.get("strip_accents", normalizer.get("strip_accents"))
    if strip is not None and bool(strip) != lower:
        warnings.warn(f"--hf-path {hf_dir}: the tokenizer has strip_accents={strip} with do_lower_case={lower}; "
                      "megatrain's WordPiece strips accents exactly when it lowercases, so accented text may "
                      "tokenize differently")
    if config.get("tokenize_chinese_chars", normalizer.get("handle_chinese_chars", True)) is False:
        warnings.warn(f"--hf-path {hf_dir}: the tokenizer has tokenize_chinese_chars=false; megatrain's WordPiece "
                      "splits CJK characters, so such text may tokenize differently")
    return _WordPiece(lower, tokens)


@dataclass
class _Found:
    """A folder's tokenizer as megatrain flags (file names relative to the folder, "." the folder
    itself), the files that belong to it, and a vocab.txt to write (BERT from tokenizer.json)."""

    tok_args: dict[str, Any]
    files: list[str]
    vocab_txt: list[str] | None = None


def _find_hf_tokenizer(hf_dir: str, architecture: str) -> _Found | None:
    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(hf_dir, name))

    if architecture == "GPT2LMHeadModel" and has("vocab.json") and has("merges.txt"):
        return _Found({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "vocab.json", "merge_file": "merges.txt"},
                      ["vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json",
                       "special_tokens_map.json"])
    wordpiece = _find_wordpiece(hf_dir)
    if wordpiece is not None:
        kind = WORDPIECE_TYPES[0] if wordpiece.lower_case else WORDPIECE_TYPES[1]
        tok_args: dict[str, Any] = {"tokenizer_type": kind, "vocab_file": "vocab.txt"}
        sentinels = _sentinel_count(wordpiece.tokens if wordpiece.tokens is not None
                                    else _read_lines(os.path.join(hf_dir, "vocab.txt")))
        if sentinels:  # T5's <extra_id_i>: megatrain's WordPiece finds them in the file with --vocab-extra-ids
            tok_args["vocab_extra_ids"] = sentinels
        return _Found(tok_args, ["vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"],
                      wordpiece.tokens)
    if has("tokenizer.json"):
        return _Found({"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "."},
                      ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", *CHAT_TEMPLATE_FILES,
                       *_extra_chat_templates(hf_dir), GENERATION_CONFIG])
    if has("tokenizer.model"):
        kind = "Llama2Tokenizer" if architecture == "LlamaForCausalLM" else "GPTSentencePieceTokenizer"
        return _Found({"tokenizer_type": kind, "tokenizer_model": "tokenizer.model"},
                      ["tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"])
    return None


def _place(found: _Found, hf_dir: str, out_dir: str) -> dict[str, Any]:
    """Copy the tokenizer's files (and write its vocab.txt) into ``out_dir``; its flags pointing there."""
    os.makedirs(out_dir, exist_ok=True)
    out_dir = os.path.abspath(out_dir)
    for name in found.files:
        if os.path.isfile(os.path.join(hf_dir, name)):
            os.makedirs(os.path.dirname(os.path.join(out_dir, name)), exist_ok=True)
            atomic_copy(os.path.join(hf_dir, name), os.path.join(out_dir, name))
    if found.vocab_txt is not None:
        with atomic_path(os.path.join(out_dir, "vocab.txt")) as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("".join(t + "\n" for t in found.vocab_txt))
    return {k: (os.path.normpath(os.path.join(out_dir, v)) if k in _FILE_FLAGS else v)
            for k, v in found.tok_args.items()}


_FILE_FLAGS = ("vocab_file", "merge_file", "tokenizer_model")  # tokenizer flags naming files of the folder


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\r\n") for line in f]
    except (OSError, UnicodeDecodeError):
        return []


def _sentinel_count(tokens: list[str]) -> int:
    """How many of ``<extra_id_0>``, ``<extra_id_1>``, ... (in that order, without gaps) ``tokens`` has."""
    present, n = set(tokens), 0
    while f"<extra_id_{n}>" in present:
        n += 1
    return n


def hf_tokenizer_vocab_size(hf_dir: str, architecture: str) -> int | None:
    """How many tokens megatrain's tokenizer for the folder's tokenizer files has (the count the trainer
    pads the vocabulary from; a WordPiece one may append sentinels); None when there is none or it
    cannot be opened."""
    found = _find_hf_tokenizer(hf_dir, architecture)
    if found is None:
        return None
    with tempfile.TemporaryDirectory() as scratch:
        try:
            return int(build_tokenizer(_place(found, hf_dir, scratch)).vocab_size)
        except (ValueError, OSError):
            return None


def import_hf_tokenizer(hf_dir: str, out_dir: str, architecture: str) -> dict[str, Any]:
    """Copy a Hugging Face folder's tokenizer files into ``out_dir``; return megatrain tokenizer flags.

    GPT-2 folders with vocab.json/merges.txt become ``GPT2BPETokenizer`` (as Megatron-LM uses), a
    BERT WordPiece tokenizer ``BertWordPieceLowerCase`` or ``BertWordPieceCase`` (its
    ``do_lower_case``) with its ``vocab.txt`` (written from ``tokenizer.json`` when the folder has
    none); otherwise tokenizer.json becomes ``HuggingFaceTokenizer`` and tokenizer.model a
    SentencePiece type. An empty dict means no tokenizer was found.
    """
    found = _find_hf_tokenizer(hf_dir, architecture)
    if found is None:
        return {}
    if found.tok_args["tokenizer_type"] == "HuggingFaceTokenizer":
        check_chat_templates(HuggingFaceTokenizer(hf_dir))  # before anything is written
    return _place(found, hf_dir, out_dir)


def check_chat_templates(tokenizer: Any) -> None:
    """Refuse a tokenizer whose chat template does not compile or that the sandbox refuses (it reaches
    for Python internals): one ValueError line; warn about one that fails on a plain conversation."""
    for line in tokenizer.check_chat_templates():
        warnings.warn(line)


def _extra_chat_templates(folder: str) -> list[str]:
    """``additional_chat_templates/NAME.jinja`` files of a folder (names relative to it)."""
    extra = os.path.join(folder, CHAT_TEMPLATE_DIR)
    if not os.path.isdir(extra):
        return []
    return [f"{CHAT_TEMPLATE_DIR}/{n}" for n in sorted(os.listdir(extra))
            if n.endswith(".jinja") and os.path.isfile(os.path.join(extra, n))]


def _copy_chat_templates(tokenizer: Any, folder: str, out_dir: str) -> list[str]:
    """Copy a HuggingFaceTokenizer's chat template files into an export. A template that only a
    processor's ``chat_template.json`` holds is also written as ``chat_template.jinja``, the file
    ``AutoTokenizer`` reads, so that it renders the conversations megatrain rendered."""
    files = []
    for name in (*CHAT_TEMPLATE_FILES, *_extra_chat_templates(folder)):
        if os.path.isfile(os.path.join(folder, name)):
            os.makedirs(os.path.dirname(os.path.join(out_dir, name)), exist_ok=True)
            atomic_copy(os.path.join(folder, name), os.path.join(out_dir, name))
            files.append(name)
    source = getattr(tokenizer, "chat_template_source", None)
    template = getattr(tokenizer, "chat_template", None)
    if template is not None and source is not None and os.path.basename(source) == "chat_template.json":
        with atomic_path(os.path.join(out_dir, "chat_template.jinja")) as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(template)
        files.append("chat_template.jinja")
    return files
