"""`tools/convert_hf_to_checkpoint.py`: a local Hugging Face folder -> a megatrain checkpoint.

The family whose adapter takes the folder's ``config.json`` converts it (GPT: GPT2LMHeadModel,
LlamaForCausalLM, continued by ``pretrain_gpt.py --load CKPT --finetune`` or ``finetune_gpt.py``;
BERT: MegatronBertForPreTraining, MegatronBertForMaskedLM, continued by ``pretrain_bert.py``; T5:
T5ForConditionalGeneration, continued by ``pretrain_t5.py`` or ``finetune.py``).

Weights are read from ``model.safetensors`` (sharded or not; memory-mapped, one tensor at a time) or
``pytorch_model.bin`` (loaded with ``weights_only=True``, never unpickling code, one file at a time),
converted one layer at a time and written as they are converted: the whole model is never in host
memory (``benchmarks/conversion_memory.py``). The checkpoint is written through DCP like any
training checkpoint, so it loads under any parallel layout. Its vocabulary is padded as the trainer
pads it (``--make-vocab-size-divisible-by`` x ``--tensor-model-parallel-size``); the original size
is recorded so that exporting gives the same rows back. The padding counts the tokens of megatrain's
tokenizer for the folder's tokenizer files when it has more than ``vocab_size`` (tokens megatrain's
tokenizer appends), so the trainer pads to the same size.
"""

from __future__ import annotations

import argparse
import os
import shlex
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict import get_state_dict
from tqdm import tqdm

from megatrain.checkpoint.errors import CheckpointError
from megatrain.checkpoint.safe_pickle import load_tensors_file
from megatrain.checkpoint.save_lock import take_save_lock
from megatrain.models.common.hf_adapter import HFAdapter, UnsupportedModelError
from megatrain.convert.streaming import StreamingConversion
from megatrain.convert.tokenizer_files import hf_tokenizer_vocab_size, import_hf_tokenizer
from megatrain.errors import user_errors_exit
from megatrain.json_input import parse_json
from megatrain.models.registry import family_for_hf
from megatrain import checkpoint as checkpointing
from megatrain.models.common.vocab import padded_vocab_size
from megatrain.checkpoint import TrainState
from megatrain.flags import OneLineArgumentParser


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="convert_hf_to_checkpoint.py", allow_abbrev=False,
                                description="Convert a local Hugging Face model folder to a megatrain checkpoint.")
    p.add_argument("--hf-path", required=True, help="folder with config.json and the weights")
    p.add_argument("--save", required=True, help="checkpoint directory to write (as pretrain_gpt.py --save)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary as the training script will (same flag, same default)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="the TP size the vocabulary padding is computed for (as the training script pads it)")
    p.add_argument("--allow-gelu-approximation", action="store_true",
                   help="no longer needed: GPT-2 models with tanh-approximated GELU (gelu_new) convert exactly "
                        "(the trainer computes that GELU by default, as Megatron-LM)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def read_hf_config(hf_path: str) -> dict[str, Any]:
    path = os.path.join(hf_path, "config.json")
    if not os.path.isdir(hf_path):
        raise ValueError(f"--hf-path {hf_path}: no such directory")
    if not os.path.isfile(path):
        raise ValueError(f"--hf-path {hf_path}: no config.json (is it a Hugging Face model folder?)")
    try:
        with open(path, "rb") as f:
            config = parse_json(f.read())
    except ValueError as e:
        raise ValueError(f"--hf-path {path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--hf-path {path}: expected a JSON object")
    return config


def _weight_files(hf_path: str) -> list[str]:
    """The weight files of a Hugging Face folder (safetensors preferred, else pytorch_model.bin)."""
    def files_from_index(index_name: str) -> list[str]:
        path = os.path.join(hf_path, index_name)
        with open(path, "rb") as f:
            try:
                weight_map = parse_json(f.read())["weight_map"]
                return sorted(set(map(str, weight_map.values())))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                reason = f"no {e} entry" if isinstance(e, KeyError) else str(e)
                raise ValueError(f"--hf-path {path}: not a weight index with a \"weight_map\" object ({reason})") from None

    if os.path.isfile(os.path.join(hf_path, "model.safetensors.index.json")):
        files = files_from_index("model.safetensors.index.json")
    elif os.path.isfile(os.path.join(hf_path, "model.safetensors")):
        files = ["model.safetensors"]
    elif os.path.isfile(os.path.join(hf_path, "pytorch_model.bin.index.json")):
        files = files_from_index("pytorch_model.bin.index.json")
    elif os.path.isfile(os.path.join(hf_path, "pytorch_model.bin")):
        files = ["pytorch_model.bin"]
    else:
        raise ValueError(f"--hf-path {hf_path}: no model.safetensors(.index.json) or pytorch_model.bin(.index.json)")
    for name in files:
        if not os.path.isfile(os.path.join(hf_path, name)):
            raise ValueError(f"--hf-path {hf_path}: the index names {name}, which is missing")
    return [os.path.join(hf_path, name) for name in files]


def read_hf_weights(hf_path: str) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face folder (safetensors preferred, pytorch_model.bin loaded safely)."""
    weights = HFWeights(hf_path)
    return {name: weights.tensor(name) for name in weights.names}


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    try:
        loaded = load_tensors_file(path)
    except CheckpointError as e:
        raise ValueError(f"--hf-path {e}") from None
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ValueError(f"--hf-path {path}: not a state dict of tensors")
    return loaded


class HFWeights:
    """The tensors of a Hugging Face folder, read one at a time: safetensors shards stay memory-mapped
    (``safe_open``) and a tensor is copied out only when asked for; ``pytorch_model.bin`` files
    (pickles, which cannot be read in part) are loaded whole, one file at a time, as the tensors of
    each are asked for."""

    def __init__(self, hf_path: str) -> None:
        from safetensors import safe_open

        self._where: dict[str, tuple[str, bool]] = {}
        self.shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._bin: tuple[str, dict[str, torch.Tensor]] | None = None
        self._open: tuple[str, Any] | None = None
        for path in _weight_files(hf_path):
            if path.endswith(".safetensors"):
                with safe_open(path, framework="pt") as handle:  # the header: names, shapes, dtypes
                    for name in handle.keys():
                        part = handle.get_slice(name)
                        self._where[name] = (path, True)
                        self.shapes[name] = (torch.Size(part.get_shape()), _SAFETENSORS_DTYPES[part.get_dtype()])
            else:
                loaded = _load_bin(path)  # its header holds no shapes: read it once here, again when used
                for name, t in loaded.items():
                    self._where[name] = (path, False)
                    self.shapes[name] = (t.shape, t.dtype)
                del loaded
        self.names = list(self._where)

    def tensor(self, name: str) -> torch.Tensor:
        path, mapped = self._where[name]
        if mapped:  # one shard mapped at a time: its pages leave this process when the next one is opened
            if self._open is None or self._open[0] != path:
                from safetensors import safe_open

                self._open = None
                self._open = (path, safe_open(path, framework="pt"))
            return self._open[1].get_tensor(name)
        if self._bin is None or self._bin[0] != path:
            self._bin = None  # the previous file's tensors go before the next file is read
            self._bin = (path, _load_bin(path))
        return self._bin[1][name]


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


class _StreamingSavePlanner(DefaultSavePlanner):
    """DCP save planning on the meta state dict; each tensor is made (``StreamingConversion.get``)
    only when the writer asks for it, and freed once the next one is asked for: DCP's writer writes
    tensors serially in state-dict order but keeps a reference to every tensor of a file until the
    file is closed, so the storage of one already written is released here (loudly unusable, never
    silently wrong, should a future writer touch it again)."""

    def __init__(self, conversion: StreamingConversion, progress: bool = True) -> None:
        super().__init__()
        self._conversion = conversion
        self._previous: torch.Tensor | None = None
        self._progress = progress
        self._bar: Any = None  # made at the first tensor: a refusal before it (the tokenizer files) prints no bar

    def close(self) -> None:
        self._release_previous()
        if self._bar is not None:
            self._bar.close()

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        self._release_previous()
        if self._bar is None:
            self._bar = tqdm(total=sum(t.nbytes for t in self._conversion.outputs.values()), unit="B",
                             unit_scale=True, desc="converting and writing", disable=not self._progress)
        name = write_item.index.fqn.removeprefix("model.")
        t = self._conversion.get(name)
        want = self._conversion.outputs[name]
        if t.shape != want.shape:
            raise UnsupportedModelError(f"{name}: converted as {tuple(t.shape)}, planned as {tuple(want.shape)}")
        if t.dtype != want.dtype:  # as load_state_dict copies into the model's parameters
            t = t.to(want.dtype)
        # A copy of its own, which nothing else holds (an output may be a source tensor kept for the
        # other groups), so it can be freed once written; the conversion's tensor goes when dropped.
        t = t.clone(memory_format=torch.contiguous_format)
        self._previous = t
        self._bar.update(t.nbytes)
        return t

    def _release_previous(self) -> None:
        t, self._previous = self._previous, None
        if t is None:
            return
        t.untyped_storage().resize_(0)


def pretrain_flags(cfg: Any, tok_args: dict[str, Any], divisible_by: int,
                   family_flags: list[str] | None = None) -> list[str]:
    """The training script's model and tokenizer flags that rebuild exactly this model (the shared
    transformer shape, then ``family_flags``: the family's own, from its adapter)."""
    flags = ["--num-layers", str(cfg.num_layers), "--hidden-size", str(cfg.hidden_size),
             "--num-attention-heads", str(cfg.num_attention_heads), "--ffn-hidden-size", str(cfg.ffn_hidden_size),
             "--max-position-embeddings", str(cfg.max_position_embeddings),
             "--make-vocab-size-divisible-by", str(divisible_by), "--norm-epsilon", repr(cfg.norm_epsilon),
             "--init-method-std", repr(cfg.init_method_std)]
    if cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
        flags += ["--kv-channels", str(cfg.kv_channels)]
    if cfg.num_query_groups != cfg.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(cfg.num_query_groups)]
    if cfg.position_embedding_type == "rope":
        flags += ["--position-embedding-type", "rope", "--rotary-base", repr(cfg.rotary_base)]
    if cfg.normalization == "RMSNorm":
        flags += ["--normalization", "RMSNorm"]
    if cfg.swiglu:
        flags += ["--swiglu"]
    if not cfg.add_bias_linear:
        flags += ["--disable-bias-linear"]
        if getattr(cfg, "add_qkv_bias", False):
            flags += ["--add-qkv-bias"]
    elif not cfg.swiglu and cfg.gelu_approximation == "none":
        flags += ["--no-bias-gelu-fusion"]  # exact GELU (the default with biases is the tanh approximation)
    if getattr(cfg, "qk_layernorm", False):
        flags += ["--qk-layernorm"]
    if getattr(cfg, "window_size", None) is not None:
        flags += ["--window-size", ",".join(str(w) for w in cfg.window_size)]
    flags += mla_flags(cfg)
    if cfg.untie_embeddings_and_output_weights:
        flags += ["--untie-embeddings-and-output-weights"]
    flags += list(family_flags or [])
    flags += ["--hidden-dropout", repr(cfg.hidden_dropout), "--attention-dropout", repr(cfg.attention_dropout)]
    for key in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_extra_ids"):
        if tok_args.get(key):
            flags += ["--" + key.replace("_", "-"), str(tok_args[key])]
    return flags


def mla_flags(cfg: Any) -> list[str]:
    """The multi-latent-attention flags of ``cfg`` (DeepSeek-V2/V3; none without it): its dims, and its
    RoPE (--rope-type; YaRN's numbers all written out, so no default of either side matters)."""
    if not getattr(cfg, "multi_latent_attention", False):
        return []
    flags = ["--multi-latent-attention"]
    if cfg.q_lora_rank is not None:
        flags += ["--q-lora-rank", str(cfg.q_lora_rank)]
    flags += ["--kv-lora-rank", str(cfg.kv_lora_rank), "--qk-head-dim", str(cfg.qk_head_dim),
              "--qk-pos-emb-head-dim", str(cfg.qk_pos_emb_head_dim), "--v-head-dim", str(cfg.v_head_dim),
              "--rope-type", cfg.rope_type]
    if cfg.rope_type == "yarn" or cfg.rotary_scaling_factor != 1.0 or cfg.mscale_all_dim != 0.0:
        flags += ["--rotary-scaling-factor", repr(cfg.rotary_scaling_factor), "--mscale", repr(cfg.mscale),
                  "--mscale-all-dim", repr(cfg.mscale_all_dim)]
    if cfg.rope_type == "yarn":
        flags += ["--yarn-original-max-position-embeddings", str(cfg.yarn_original_max_position_embeddings),
                  "--yarn-beta-fast", repr(cfg.yarn_beta_fast), "--yarn-beta-slow", repr(cfg.yarn_beta_slow)]
    return flags


def import_hf_model(hf_path: str, save: str, *, make_vocab_size_divisible_by: int = 128,
                    tensor_model_parallel_size: int = 1, allow_gelu_approximation: bool = False,
                    progress: bool = True) -> str:
    """Convert ``hf_path`` into ``save``; returns the written checkpoint directory.

    Host memory: about one layer in fp32 besides the memory-mapped shards (no copy of the whole model).
    """
    if make_vocab_size_divisible_by <= 0 or tensor_model_parallel_size <= 0:
        raise ValueError("--make-vocab-size-divisible-by and --tensor-model-parallel-size must be positive")
    hf_config = read_hf_config(hf_path)
    if allow_gelu_approximation:
        print(" note: --allow-gelu-approximation is no longer needed: tanh-approximated GELU converts exactly",
              flush=True)
    text_config = hf_config.get("text_config")  # a vision-language model's (LLaVA's) text vocabulary
    vocab = hf_config.get("vocab_size", text_config.get("vocab_size") if isinstance(text_config, dict) else None)
    if vocab is None:
        raise UnsupportedModelError(f"--hf-path {hf_path}: config.json has no vocab_size")
    hf_vocab = int(vocab)
    padded = padded_vocab_size(hf_vocab, make_vocab_size_divisible_by, tensor_model_parallel_size)
    family = family_for_hf(hf_config)
    cfg, architecture = family.hf.config_from_hf(hf_config, padded)
    tokens = hf_tokenizer_vocab_size(hf_path, architecture) or 0  # the size the trainer will pad from
    if padded_vocab_size(max(hf_vocab, tokens), make_vocab_size_divisible_by, tensor_model_parallel_size) != padded:
        padded = padded_vocab_size(tokens, make_vocab_size_divisible_by, tensor_model_parallel_size)
        cfg, architecture = family.hf.config_from_hf(hf_config, padded)

    # Streamed: the shards stay memory-mapped, each layer is read, converted (in fp32, as the trainer
    # holds it) and written in turn, and the model itself is only ever built on the meta device.
    weights = HFWeights(hf_path)
    conversion = StreamingConversion(weights.shapes, weights.tensor,
                                     lambda hf: family.hf.from_hf_state_dict(hf, cfg, architecture), cast=torch.float32)
    with torch.device("meta"):
        model = family.build_model(cfg)
    model_state = get_state_dict(model, [])[0]
    missing = sorted(set(model_state) - set(conversion.outputs))
    unexpected = sorted(set(conversion.outputs) - set(model_state))
    if missing or unexpected:
        raise UnsupportedModelError(f"conversion produced missing {missing} / unexpected {unexpected} tensors")
    for name, t in model_state.items():
        if conversion.outputs[name].shape != t.shape:
            made = tuple(conversion.outputs[name].shape)
            raise UnsupportedModelError(f"conversion produced {name} of shape {made}, the model's is {tuple(t.shape)}")
    conversion.outputs = model_state  # the planner checks and casts to the model's own shapes and dtypes
    planner = _StreamingSavePlanner(conversion, progress)

    lock = take_save_lock(save)  # nothing else writes into --save meanwhile (a training run, another import)
    try:
        return _write(hf_path, save, model, cfg, architecture, hf_vocab, padded, make_vocab_size_divisible_by,
                      tensor_model_parallel_size, family.hf, model_state, planner)
    finally:
        planner.close()
        if lock is not None:
            lock.release()


def _write(hf_path: str, save: str, model: torch.nn.Module, cfg: Any, architecture: str, hf_vocab: int, padded: int,
           make_vocab_size_divisible_by: int, tensor_model_parallel_size: int, adapter: HFAdapter,
           model_state: dict[str, Any] | None = None, planner: Any = None) -> str:
    """The tokenizer files and the checkpoint of a converted model, written into ``save`` (locked)."""
    tok_args = import_hf_tokenizer(hf_path, os.path.join(save, "tokenizer"), architecture)
    if not tok_args:
        warnings.warn(f"--hf-path {hf_path}: no tokenizer files found; pass tokenizer flags when training")
    flags = pretrain_flags(cfg, tok_args, make_vocab_size_divisible_by, adapter.family_flags(cfg))
    args = argparse.Namespace(
        **tok_args, hf_vocab_size=hf_vocab, converted_from=os.path.abspath(hf_path), hf_architecture=architecture,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        tensor_model_parallel_size=tensor_model_parallel_size, pretrain_flags=flags)
    ckpt = checkpointing.save_checkpoint(save, TrainState(iteration=0), model, None, {}, args, cfg,
                                         save_optim=False, save_rng=False, model_state=model_state, planner=planner)
    print(f" converted {architecture} from {hf_path} ({model.num_parameters():,} parameters, vocabulary {hf_vocab} "
          f"padded to {padded}) into {ckpt}", flush=True)
    print(f" continue from it with {adapter.script} and these model/tokenizer flags:\n   " + shlex.join(flags)
          + f" --load {shlex.quote(save)} --finetune", flush=True)
    return ckpt


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import_hf_model(args.hf_path, args.save, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                    tensor_model_parallel_size=args.tensor_model_parallel_size,
                    allow_gelu_approximation=args.allow_gelu_approximation, progress=not args.no_progress)
