"""The run arguments a Megatron-LM checkpoint stores (``args``) and megatrain's GPT config.

Megatron-LM and megatrain share flag names, so a Megatron ``args`` namespace mostly reads as
megatrain's: `config_from_megatron_args` completes what Megatron's ``validate_args`` derives and
stores differently (``num_query_groups`` without ``--group-query-attention``, ``bias_gelu_fusion``,
the older ``layernorm_epsilon``) and builds the GPT config through the family's own
``config_from_args``. `megatron_args` is the inverse: the namespace a Megatron checkpoint written by
megatrain carries, with exactly the fields Megatron's loaders read (model shape, parallel sizes,
padded vocabulary, counters, tokenizer).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from megatrain.convert.megatron.names import UnsupportedMegatronModel
from megatrain.models.registry import get_family

__all__ = ["config_from_megatron_args", "megatron_args", "MODEL_ARG_NAMES"]

# Megatron's defaults for fields an older checkpoint may lack.
_DEFAULTS: dict[str, Any] = {
    "position_embedding_type": "learned_absolute", "rotary_base": 10000, "rotary_percent": 1.0,
    "normalization": "LayerNorm", "norm_epsilon": 1e-5, "swiglu": False, "add_bias_linear": True,
    "untie_embeddings_and_output_weights": False, "hidden_dropout": 0.1, "attention_dropout": 0.1,
    "init_method_std": 0.02, "group_query_attention": False, "bias_gelu_fusion": True, "kv_channels": None,
    "ffn_hidden_size": None, "num_experts": None,
}

#: Megatron argument names that describe the model (what --use-checkpoint-args takes)
MODEL_ARG_NAMES = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
                   "num_query_groups", "kv_channels", "max_position_embeddings", "position_embedding_type",
                   "rotary_base", "rotary_percent", "rotary_interleaved", "use_rope_scaling", "rope_scaling_factor",
                   "normalization", "norm_epsilon", "apply_layernorm_1p", "swiglu", "add_bias_linear",
                   "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights", "hidden_dropout",
                   "attention_dropout", "init_method_std", "bias_gelu_fusion", *(
                       # multi-latent attention
                       "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                       "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
                       "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow"))
#: megatrain's multi-latent-attention config fields, stored under Megatron's argument names (the same)
MLA_ARG_NAMES = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
                 "rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
                 "yarn_beta_fast", "yarn_beta_slow")


def config_from_megatron_args(saved: argparse.Namespace | dict[str, Any], where: str) -> Any:
    """megatrain's GPT config for a Megatron checkpoint's ``args`` (``where``: the file, for errors)."""
    values = dict(vars(saved)) if isinstance(saved, argparse.Namespace) else dict(saved)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"):
        if values.get(name) is None:
            raise UnsupportedMegatronModel(f"{where}: its args have no {name}")
    if "norm_epsilon" not in values and "layernorm_epsilon" in values:  # before Megatron-LM renamed it
        values["norm_epsilon"] = values["layernorm_epsilon"]
    if values.get("position_embedding_type") is None and values.get("use_rotary_position_embeddings"):
        values["position_embedding_type"] = "rope"  # legacy models' --use-rotary-position-embeddings, before the type
    for name, default in _DEFAULTS.items():
        if values.get(name) is None:
            values[name] = default
    if not values["group_query_attention"]:
        values["num_query_groups"] = values["num_attention_heads"]
    if values["kv_channels"] is None:
        values["kv_channels"] = values["hidden_size"] // values["num_attention_heads"]
    if values["ffn_hidden_size"] is None:
        ffn = 4 * values["hidden_size"]
        values["ffn_hidden_size"] = int(ffn * 2 / 3 / 64) * 64 if values["swiglu"] else ffn
    values["no_bias_gelu_fusion"] = not values["bias_gelu_fusion"]
    if values.get("window_size") is not None:
        values["window_size"] = tuple(values["window_size"])
    vocab = values.get("padded_vocab_size")
    if not vocab:
        raise UnsupportedMegatronModel(f"{where}: its args have no padded_vocab_size")
    try:
        return get_family("gpt").config_from_args(argparse.Namespace(**values), int(vocab))
    except (TypeError, ValueError) as e:
        raise UnsupportedMegatronModel(f"{where}: its args describe a model megatrain cannot build ({e})") from None


def megatron_args(cfg: Any, *, tp: int, pp: int, iteration: int, consumed_train_samples: int = 0,
                  consumed_valid_samples: int = 0, tokenizer: dict[str, Any] | None = None,
                  ckpt_format: str = "torch_dist", transformer_impl: str = "transformer_engine",
                  seq_length: int | None = None) -> argparse.Namespace:
    """The ``args`` a Megatron checkpoint of ``cfg`` carries (plain values only: no enums)."""
    gqa = cfg.num_query_groups != cfg.num_attention_heads
    values: dict[str, Any] = {
        "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "ffn_hidden_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.num_attention_heads, "group_query_attention": gqa,
        "num_query_groups": cfg.num_query_groups if gqa else 1, "kv_channels": cfg.kv_channels,
        "max_position_embeddings": cfg.max_position_embeddings,
        "seq_length": seq_length or cfg.max_position_embeddings,
        "position_embedding_type": cfg.position_embedding_type, "rotary_base": int(cfg.rotary_base)
        if float(cfg.rotary_base).is_integer() else cfg.rotary_base, "rotary_percent": cfg.rotary_percent,
        "rotary_interleaved": cfg.rotary_interleaved, "use_rope_scaling": cfg.use_rope_scaling,
        "rope_scaling_factor": cfg.rope_scaling_factor, "normalization": cfg.normalization,
        "norm_epsilon": cfg.norm_epsilon, "apply_layernorm_1p": cfg.apply_layernorm_1p, "swiglu": cfg.swiglu,
        "add_bias_linear": cfg.add_bias_linear, "add_qkv_bias": cfg.add_qkv_bias, "qk_layernorm": cfg.qk_layernorm,
        "untie_embeddings_and_output_weights": cfg.untie_embeddings_and_output_weights,
        "hidden_dropout": cfg.hidden_dropout, "attention_dropout": cfg.attention_dropout,
        "init_method_std": cfg.init_method_std, "bias_gelu_fusion": cfg.gelu_approximation == "tanh",
        "padded_vocab_size": cfg.vocab_size, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": None, "iteration": iteration,
        "consumed_train_samples": consumed_train_samples, "consumed_valid_samples": consumed_valid_samples,
        "ckpt_format": ckpt_format, "transformer_impl": transformer_impl, "use_legacy_models": False,
        "num_experts": cfg.num_moe_experts, "fp16": False, "bf16": False, "params_dtype": None,
    }
    values["multi_latent_attention"] = bool(getattr(cfg, "multi_latent_attention", False))
    if values["multi_latent_attention"]:  # Megatron's MLA flags are our config's field names
        values.update({name: getattr(cfg, name) for name in MLA_ARG_NAMES})
    if cfg.num_moe_experts:  # Megatron's MoE flags are our config's field names
        values.update({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name.startswith("moe_")})
    values.update({k: v for k, v in (tokenizer or {}).items() if v is not None})
    import torch

    values["params_dtype"] = torch.float32
    return argparse.Namespace(**values)
