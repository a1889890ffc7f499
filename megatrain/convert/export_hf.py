"""`tools/convert_checkpoint_to_hf.py`: a megatrain checkpoint -> a Hugging Face model folder.

The checkpoint is read into one process (DCP reshards whatever layout saved it: TP, FSDP, DDP) one
layer at a time (`CheckpointTensors`, `StreamingConversion`: about one layer plus the shard being
written in host memory), mapped to the Hugging Face class its family's adapter chooses (GPT: GPT2LMHeadModel or
LlamaForCausalLM; BERT: MegatronBertForPreTraining or MegatronBertForMaskedLM; T5:
T5ForConditionalGeneration; LLaVA: LlavaForConditionalGeneration, with preprocessor_config.json) and written as
``config.json``, ``generation_config.json`` (generative families), ``model.safetensors`` (or shards
plus ``model.safetensors.index.json``) and the tokenizer files. ``transformers`` is not needed to
export.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any, Callable

import torch

from megatrain.atomic_io import atomic_path, atomic_write_json
from megatrain.convert.streaming import StreamingConversion
from megatrain.convert.tokenizer_files import SpecialTokens, open_tokenizer, write_hf_tokenizer
from megatrain.data.tokenizers.huggingface import GENERATION_CONFIG
from megatrain.errors import user_errors_exit
from megatrain.json_input import parse_json
from megatrain.models.common.init import canonical_parameter_name
from megatrain.models.registry import ModelFamily, family_of_config, get_family
from megatrain import checkpoint as checkpointing
from megatrain.flags import OneLineArgumentParser

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size",
                    "vocab_extra_ids", "tiktoken_pattern", "tiktoken_num_special_tokens", "tiktoken_special_tokens")


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a plain number of bytes -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB or 1000000")
    unit = (m.group(2) or "B").upper()
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base**power)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="convert_checkpoint_to_hf.py", allow_abbrev=False,
                                description="Export a megatrain checkpoint as a Hugging Face model folder.")
    p.add_argument("--checkpoint-path", "--load", dest="checkpoint_path", required=True,
                   help="a --save directory (newest checkpoint) or one iter_XXXXXXX folder")
    p.add_argument("--ckpt-step", type=int, default=None, help="export this iteration instead of the newest")
    p.add_argument("--output-path", required=True, help="folder to write (created if missing)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the written weights")
    p.add_argument("--max-shard-size", default="5GB", help="split model.safetensors above this size")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="rows of the exported embedding (default: the vocabulary the model was imported with, "
                        "else the tokenizer's size for families that export it (BERT), else the padded size)")
    p.add_argument("--tokenizer-type", default=None, help="override the checkpoint's tokenizer flags")
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def load_full_state_dict(ckpt: str, cfg: Any, family: ModelFamily | None = None) -> dict[str, torch.Tensor]:
    """All model tensors of ``ckpt`` as whole CPU tensors with canonical names (any saved layout)."""

    with torch.device("meta"):
        model = (family or family_of_config(cfg)).build_model(cfg)
    model.to_empty(device=torch.device("cpu"))
    checkpointing.load_checkpoint(ckpt, model, None, load_optim=False, load_rng=False)
    return {canonical_parameter_name(k): v.detach() for k, v in model.state_dict().items()}


class CheckpointTensors:
    """The model tensors of a checkpoint, read one at a time with canonical names (DCP reads only the
    bytes of the tensor asked for, from any saved layout), for exporting without the whole model in
    memory. Checked as `load_checkpoint` checks a whole load: shapes against the checkpoint's own
    model config, and no NaN/Inf."""

    def __init__(self, ckpt: str, cfg: Any, family: ModelFamily | None = None) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from megatrain.checkpoint.load import compare_model, model_shapes
        from megatrain.checkpoint.safe_pickle import read_dcp_metadata

        with torch.device("meta"):
            model = (family or family_of_config(cfg)).build_model(cfg)
        model_sd = get_state_dict(model, [])[0]
        self._ckpt, self._metadata = ckpt, read_dcp_metadata(ckpt)
        diff = compare_model(model_shapes(self._metadata), model_sd)
        if any(diff.values()):
            lines = ([f"shape differs: {x}" for x in diff["shape"]]
                     + [f"not in the checkpoint: {k}" for k in diff["missing"]]
                     + [f"in the checkpoint but not in the model: {k}" for k in diff["unexpected"]])
            raise checkpointing.CheckpointError(f"checkpoint {ckpt} does not match its own model config: "
                                                + "; ".join(lines[:8]))
        self._fqn = {canonical_parameter_name(k): k for k in model_sd}
        self.shapes = {canonical_parameter_name(k): (v.shape, v.dtype) for k, v in model_sd.items()}

    def read(self, name: str) -> torch.Tensor:
        from megatrain.checkpoint.dcp_reader import load_dcp
        from megatrain.checkpoint.load import _refuse_non_finite
        from megatrain.checkpoint.ranks import single_process_quiet

        shape, dtype = self.shapes[name]
        sd = {"model": {self._fqn[name]: torch.empty(shape, dtype=dtype)}}
        with single_process_quiet():
            load_dcp(sd, self._ckpt, self._metadata, allow_partial_load=True)
        _refuse_non_finite(self._ckpt, sd, False)
        return sd["model"][self._fqn[name]]


def write_safetensors(tensors: dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int,
                      progress: bool = True, dtype: torch.dtype | None = None,
                      fetch: Callable[[str], torch.Tensor] | None = None) -> list[str]:
    """``model.safetensors``, or shards + ``model.safetensors.index.json`` above ``max_shard_bytes``.

    ``tensors`` may be views of the model's tensors (a layer's experts sliced out of one stacked
    tensor): each shard is copied into standalone tensors (of ``dtype``, if given) only as it is
    written, so no second copy of the whole model is ever held. With ``fetch``, ``tensors`` only
    gives names, shapes and dtypes (meta tensors) and ``fetch(name)`` each tensor as its shard is
    written (a streamed export: one shard in memory).
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    def size_of(t: torch.Tensor) -> int:
        return t.numel() * (t.element_size() if dtype is None else torch.empty((), dtype=dtype).element_size())

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = size_of(t)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = sum(size_of(t) for t in tensors.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="writing weights", disable=not progress)
    try:
        for fname, shard in zip(names, shards):
            with atomic_path(os.path.join(out_dir, fname)) as tmp:
                save_file({k: (v if fetch is None else fetch(k)).to(dtype=dtype or v.dtype,
                                                                  memory_format=torch.contiguous_format, copy=True)
                           for k, v in shard.items()}, tmp, metadata={"format": "pt"})
            bar.update(sum(size_of(t) for t in shard.values()))
    finally:
        bar.close()
    if len(shards) > 1:
        weight_map = {k: fname for fname, shard in zip(names, shards) for k in shard}
        atomic_write_json(os.path.join(out_dir, "model.safetensors.index.json"),
                          {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    else:
        stale = os.path.join(out_dir, "model.safetensors.index.json")
        if os.path.exists(stale):
            os.remove(stale)
    return names


def export_checkpoint(checkpoint_path: str, output_path: str, *, dtype: str = "fp32", step: int | None = None,
                      max_shard_size: str = "5GB", vocab_size: int | None = None,
                      tokenizer_overrides: dict[str, Any] | None = None, progress: bool = True) -> dict[str, Any]:
    """Export one checkpoint; returns the written config.json content."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    ckpt = checkpointing.find_checkpoint(checkpoint_path, step)
    if ckpt is None:
        raise ValueError(f"--checkpoint-path {checkpoint_path}: no checkpoint found (no {checkpointing.TRACKER})")
    meta = checkpointing.read_meta(ckpt)
    if "model_config" not in meta:
        raise ValueError(f"--checkpoint-path {ckpt}: meta.json has no model_config")
    cfg = checkpointing.checkpoint_model_config(ckpt, meta)
    family = get_family(checkpointing.checkpoint_family(meta))
    if family.hf is None:
        raise ValueError(f"--checkpoint-path {ckpt}: the {family.name} model family has no Hugging Face export")
    hf = family.hf
    architecture = hf.architecture(cfg)  # refuse before reading any weights
    saved_args = meta.get("args", {}) or {}
    imported_as = saved_args.get("hf_architecture")
    if imported_as and imported_as != architecture and hf.exports_as is not None and hf.exports_as(cfg, imported_as):
        architecture = imported_as  # back to the class it came from (Mistral rather than Llama)
    max_shard_bytes = parse_size(max_shard_size)
    tok_args = {k: saved_args.get(k) for k in TOKENIZER_FIELDS if saved_args.get(k) is not None}
    for k, v in (tokenizer_overrides or {}).items():
        if v is not None:
            tok_args[k] = v
    tokenizer = open_tokenizer(tok_args)
    rows = vocab_size or saved_args.get("hf_vocab_size")
    if not rows and hf.vocab_from_tokenizer:  # the tokenizer's true size: no padding rows in the export
        if tokenizer is None:
            raise ValueError(f"--checkpoint-path {ckpt}: a {architecture} export has as many vocabulary rows as the "
                             "tokenizer has tokens, and the tokenizer cannot be opened; pass its flags "
                             "(--tokenizer-type, --vocab-file) or --vocab-size")
        rows = tokenizer.vocab_size
        if rows > cfg.vocab_size:
            raise ValueError(f"--checkpoint-path {ckpt}: the tokenizer has {rows} tokens but the model's embedding "
                             f"only {cfg.vocab_size} rows; is it the tokenizer the model was trained with?")
    rows = rows or cfg.vocab_size
    if rows <= 0:
        raise ValueError(f"--vocab-size must be positive, got {rows}")

    print(f" exporting {ckpt} ({architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}) to {output_path}",
          flush=True)
    if getattr(cfg, "mtp_num_layers", 0):
        print(f" note: the {cfg.mtp_num_layers} multi-token prediction depths (mtp.*) are left out: they train the "
              f"model, and {architecture} has no place for them (the next-token model is exported whole)", flush=True)
    # Streamed: each layer is read, mapped and copied into the shard being written in turn. The adapter
    # may still refuse the weights themselves (T5's non-zero tied output bias): that is seen here, and
    # the output directory is made only once there is something to write into it.
    tensors = CheckpointTensors(ckpt, cfg, family)
    conversion = StreamingConversion(tensors.shapes, tensors.read,
                                     lambda sd: hf.to_hf_state_dict(sd, cfg, architecture, vocab_size=rows))
    hf_state = conversion.outputs  # meta tensors: names, shapes, dtypes; the values come through fetch
    os.makedirs(output_path, exist_ok=True)

    special = (write_hf_tokenizer(tok_args, output_path, cfg.max_position_embeddings, tokenizer=tokenizer,
                                  vocab_rows=rows, extra_config=hf.tokenizer_config)
               if tokenizer is not None else SpecialTokens())

    names = write_safetensors(hf_state, output_path, max_shard_bytes, progress=progress, dtype=DTYPES[dtype],
                              fetch=conversion.get)
    ids: dict[str, int | None] = {"bos_token_id": special.bos_token_id, "eos_token_id": special.eos_token_id,
                                  "pad_token_id": special.pad_token_id}
    if hf.special_token_ids is not None and tokenizer is not None:  # the family's own rule (T5's decoder start)
        ids.update(hf.special_token_ids(tokenizer))
    config = hf.config_dict(cfg, architecture, vocab_size=rows, dtype=DTYPE_NAMES[dtype], **ids)
    atomic_write_json(os.path.join(output_path, "config.json"), config, indent=2, sort_keys=True)
    extra_files = getattr(hf, "extra_files", None)  # a family's own files (LLaVA's preprocessor_config.json)
    for name, content in (extra_files(cfg, saved_args) if extra_files is not None else {}).items():
        atomic_write_json(os.path.join(output_path, name), content, indent=2, sort_keys=True)
    if hf.generation_config:
        generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
        for key in ("pad_token_id", "decoder_start_token_id"):
            if config.get(key) is not None:
                generation[key] = config[key]
        end_ids = list(getattr(tokenizer, "end_ids", None) or [])
        if len(end_ids) > 1 and end_ids[0] == generation["eos_token_id"]:
            generation["eos_token_id"] = end_ids  # a chat model's end-of-turn ids, as its folder had them
        if GENERATION_CONFIG in special.files:  # the imported folder's own defaults, our ids over them
            with open(os.path.join(output_path, GENERATION_CONFIG), "rb") as f:
                theirs = parse_json(f.read())
            generation = {**(theirs if isinstance(theirs, dict) else {}), **generation}
        atomic_write_json(os.path.join(output_path, "generation_config.json"), generation, indent=2, sort_keys=True)
    n_params = sum(t.numel() for t in hf_state.values())
    print(f" wrote {architecture} ({n_params:,} parameters, {dtype}) as {', '.join(names)}"
          + (f"; tokenizer: {', '.join(special.files)}" if special.files else "; no tokenizer files"), flush=True)
    return config


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    export_checkpoint(args.checkpoint_path, args.output_path, dtype=args.dtype, step=args.ckpt_step,
                      max_shard_size=args.max_shard_size, vocab_size=args.vocab_size,
                      tokenizer_overrides={"tokenizer_type": args.tokenizer_type, "vocab_file": args.vocab_file,
                                           "merge_file": args.merge_file, "tokenizer_model": args.tokenizer_model},
                      progress=not args.no_progress)
