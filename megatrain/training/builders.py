"""Turning parsed arguments into the objects a run needs: model config, padded vocab, precision."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from megatrain.models.gpt.config import GPTConfig


def padded_vocab_size(orig_vocab_size: int, make_vocab_size_divisible_by: int, tensor_parallel_size: int = 1) -> int:
    """Megatron's vocabulary padding: round up to a multiple of divisible_by * TP."""
    multiple = make_vocab_size_divisible_by * tensor_parallel_size
    return int(math.ceil(orig_vocab_size / multiple) * multiple)


def gelu_approximation_from_args(args: argparse.Namespace) -> str:
    """Megatron-LM's GELU: with linear biases its default fused bias-GELU computes the tanh
    approximation; ``--no-bias-gelu-fusion`` (or no biases) gives exact GELU."""
    fused = getattr(args, "add_bias_linear", True) and not getattr(args, "no_bias_gelu_fusion", False)
    return "tanh" if fused and not args.swiglu else "none"


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    """GPTConfig from Megatron-style flags; ``vocab_size`` is already padded."""
    return GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        apply_layernorm_1p=bool(getattr(args, "apply_layernorm_1p", False)),
        normalization=args.normalization,
        norm_epsilon=args.norm_epsilon,
        swiglu=args.swiglu,
        gelu_approximation=gelu_approximation_from_args(args),
        add_bias_linear=args.add_bias_linear,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        fp32_residual_connection=bool(getattr(args, "fp32_residual_connection", False)),
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
    )


@dataclass
class Precision:
    """Compute dtype of a run: parameters stay fp32 (master weights), matmuls run in ``dtype``."""

    dtype: torch.dtype

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Precision":
        if args.bf16:
            return cls(torch.bfloat16)
        if args.fp16:
            return cls(torch.float16)
        return cls(torch.float32)

    @property
    def name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]

    def autocast(self, device: torch.device):
        """Autocast context for the forward pass (a no-op for fp32)."""
        if self.dtype == torch.float32:
            return torch.autocast(device_type=device.type, enabled=False)
        return torch.autocast(device_type=device.type, dtype=self.dtype)


def choose_device(requested: str | None, local_rank: int = 0) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available (or requested), else cpu."""
    if requested == "cpu":
        return torch.device("cpu")
    if requested and requested.startswith("cuda") or (requested is None and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda was given but CUDA is not available")
        return torch.device("cuda", local_rank)
    if requested not in (None, "cpu"):
        raise SystemExit(f"error: --device must be cpu or cuda, got {requested!r}")
    return torch.device("cpu")
