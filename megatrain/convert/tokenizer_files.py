"""Tokenizer files between megatrain's tokenizer flags and a Hugging Face model folder.

Export: the tokenizer a checkpoint was trained with (its ``--tokenizer-type`` and files) becomes the
files ``AutoTokenizer.from_pretrained`` reads: ``tokenizer.json`` (+ ``vocab.json``/``merges.txt``
for GPT-2 BPE), or ``tokenizer.model`` for SentencePiece, plus ``tokenizer_config.json`` and
``special_tokens_map.json``. Import: the tokenizer files of a Hugging Face folder are copied into the
checkpoint and described with the matching megatrain flags.
"""

from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Any

from megatrain.atomic_io import atomic_path, atomic_write_json
from megatrain.data.tokenizers import GPT2_EOD, _load_gpt2_files, build_tokenizer


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


def write_hf_tokenizer(tok_args: dict[str, Any], out_dir: str, model_max_length: int) -> SpecialTokens:
    """Write the Hugging Face tokenizer files for the tokenizer ``tok_args`` describes.

    Returns the special ids for config.json; a tokenizer type without a Hugging Face form writes
    nothing and warns (the model files are still complete).
    """
    kind = tok_args.get("tokenizer_type")
    if kind is None:
        warnings.warn("the checkpoint records no --tokenizer-type; no tokenizer files were written")
        return SpecialTokens()
    try:
        tokenizer = build_tokenizer(tok_args)
    except (ValueError, OSError) as e:
        warnings.warn(f"cannot open the checkpoint's tokenizer ({e}); no tokenizer files were written "
                      "(pass the tokenizer flags to point at its files)")
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
    else:
        warnings.warn(f"--tokenizer-type {kind} has no Hugging Face tokenizer form here; no tokenizer files "
                      "were written (copy your tokenizer beside the model yourself)")
        return SpecialTokens(getattr(tokenizer, "bos", None), tokenizer.eod, None)

    atomic_write_json(os.path.join(out_dir, "tokenizer_config.json"), config, indent=2, sort_keys=True)
    atomic_write_json(os.path.join(out_dir, "special_tokens_map.json"), special, indent=2, sort_keys=True)
    files += ["tokenizer_config.json", "special_tokens_map.json"]
    return SpecialTokens(ids.bos_token_id, ids.eos_token_id, ids.pad_token_id, files)


def import_hf_tokenizer(hf_dir: str, out_dir: str, architecture: str) -> dict[str, Any]:
    """Copy a Hugging Face folder's tokenizer files into ``out_dir``; return megatrain tokenizer flags.

    GPT-2 folders with vocab.json/merges.txt become ``GPT2BPETokenizer`` (as Megatron-LM uses);
    otherwise tokenizer.json becomes ``HuggingFaceTokenizer`` and tokenizer.model a SentencePiece
    type. An empty dict means no tokenizer was found.
    """
    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(hf_dir, name))

    os.makedirs(out_dir, exist_ok=True)
    out_dir = os.path.abspath(out_dir)

    def copy(*names: str) -> None:
        for name in names:
            if has(name):
                atomic_copy(os.path.join(hf_dir, name), os.path.join(out_dir, name))

    if architecture == "GPT2LMHeadModel" and has("vocab.json") and has("merges.txt"):
        copy("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
        return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": os.path.join(out_dir, "vocab.json"),
                "merge_file": os.path.join(out_dir, "merges.txt")}
    if has("tokenizer.json"):
        copy("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": out_dir}
    if has("tokenizer.model"):
        copy("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
        kind = "Llama2Tokenizer" if architecture == "LlamaForCausalLM" else "GPTSentencePieceTokenizer"
        return {"tokenizer_type": kind, "tokenizer_model": os.path.join(out_dir, "tokenizer.model")}
    return {}
