"""Typed configuration of the T5 model family (Megatron-LM's ``T5Model``)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from megatrain.models.common.bias_gradient_kernel import kernel_available
from megatrain.models.common.config import TransformerConfig, transformer_fields_from_args
from megatrain.models.common.flex_attention import cuda_kernel_options

__all__ = ["T5Config", "t5_config_from_args", "ATTENTION_BACKENDS", "attention_backend_from_args",
           "BIAS_GRADIENTS", "bias_gradient_from_env", "recomputes_bias_gradient",
           "uses_flex_attention", "attention_description"]

ATTENTION_BACKENDS = ("auto", "flex", "sdpa")
BIAS_GRADIENTS = ("auto", "mask", "recompute")
BIAS_GRADIENT_ENV = "MEGATRAIN_T5_BIAS_GRADIENT"
# Megatron-LM's --attention-backend values (and megatrain's "flex") -> T5Config.attention_backend:
# flash / fused / auto / unfused / local all give SDPA (it picks its fused kernel itself), "flex" the
# FlexAttention path.
_MEGATRON_ATTENTION_BACKENDS = {"auto": "auto", "flash": "auto", "fused": "auto", "unfused": "sdpa", "local": "sdpa",
                                "flex": "flex", "sdpa": "sdpa"}


def attention_backend_from_args(args: argparse.Namespace) -> str:
    """T5Config.attention_backend from ``--attention-backend`` (None: "auto")."""
    value = getattr(args, "attention_backend", None)
    if value is None:
        return "auto"
    if value not in _MEGATRON_ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {', '.join(_MEGATRON_ATTENTION_BACKENDS)}, got {value!r}")
    backend = _MEGATRON_ATTENTION_BACKENDS[value]
    if uses_flex_attention(backend):
        cuda_kernel_options()  # a malformed MEGATRAIN_FLEX_KERNEL_OPTIONS is an error at start-up, not in the step
    return backend


@dataclass
class T5Config(TransformerConfig):
    """An encoder-decoder transformer: ``num_layers`` encoder layers (``--encoder-num-layers``, as
    Megatron's ``args.num_layers``) and ``decoder_num_layers`` decoder layers (default the same), of
    one shape, sharing one word (+ position) embedding with the output layer (unless untied).

    ``position_embedding_type`` "relative": T5's bucketed relative position bias,
    ``relative_attention_num_buckets`` buckets up to ``relative_attention_max_distance``, one table
    for the encoder and one for the decoder. ``decoder_seq_length`` is the decoder's input length
    (``--decoder-seq-length``): the FLOPs formula counts it; the weights do not depend on it.

    ``attention_backend`` (from Megatron's ``--attention-backend``; a kernel choice, the same numbers):
    "sdpa": PyTorch SDPA, with the relative position bias and the padding folded into one float mask
    [b, heads, s, s] per stack; "flex": FlexAttention (:mod:`megatrain.models.common.flex_attention`:
    the bias as a score_mod over a [heads, distances] table, padding and causality as a block mask;
    no attention dropout, no backward on CPU); "auto": SDPA (see :func:`uses_flex_attention`).
    """

    decoder_num_layers: int | None = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    decoder_seq_length: int | None = None
    attention_backend: str = "auto"  # "auto", "flex" or "sdpa"
    # Through SDPA, how the trained relative bias gets its gradient: "mask" (SDPA's own, from a float mask
    # that requires a gradient), "recompute" (SDPA on the detached mask; the bias gradient recomputed
    # apart, megatrain.models.common.bias_gradient) or "auto" (recompute where its Triton kernel runs: CUDA
    # with Triton; else mask). The same numbers; a speed choice (MEGATRAIN_T5_BIAS_GRADIENT, see
    # bias_gradient_from_env, and recomputes_bias_gradient).
    bias_gradient: str = "auto"
    # The masks are explicit: encoder padding, decoder causal + padding, encoder padding for cross-attention.
    causal_attention: ClassVar[bool] = False
    position_embedding_types: ClassVar[tuple[str, ...]] = ("learned_absolute", "relative", "rope")
    supports_moe: ClassVar[bool] = False  # --num-experts is refused (no MoE layers in T5)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.decoder_num_layers is None:
            self.decoder_num_layers = self.num_layers
        if self.decoder_num_layers <= 0:
            raise ValueError(f"--decoder-num-layers must be positive, got {self.decoder_num_layers}")
        if self.num_query_groups != self.num_attention_heads:
            raise ValueError("--group-query-attention is not supported for T5: its cross-attention has one "
                             "key/value head per query head (as Megatron's CrossAttention)")
        if self.position_embedding_type == "relative":
            if self.relative_attention_num_buckets < 4:
                raise ValueError(f"--relative-attention-num-buckets must be at least 4, got "
                                 f"{self.relative_attention_num_buckets}")
            if self.relative_attention_max_distance <= self.relative_attention_num_buckets // 2:
                raise ValueError(f"--relative-attention-max-distance ({self.relative_attention_max_distance}) must "
                                 f"exceed half of --relative-attention-num-buckets "
                                 f"({self.relative_attention_num_buckets}): the exactly bucketed distances")
        if self.decoder_seq_length is not None and self.decoder_seq_length <= 0:
            raise ValueError(f"--decoder-seq-length must be positive, got {self.decoder_seq_length}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"T5 attention_backend must be {', '.join(ATTENTION_BACKENDS)}, got "
                             f"{self.attention_backend!r}")
        if self.bias_gradient not in BIAS_GRADIENTS:
            raise ValueError(f"T5 bias_gradient must be {', '.join(BIAS_GRADIENTS)}, got {self.bias_gradient!r}")
        if self.attention_backend == "flex":
            from megatrain.models.common.flex_attention import flex_attention_available

            if not flex_attention_available():
                raise ValueError("FlexAttention needs torch.nn.attention.flex_attention (torch >= 2.5)")
            if self.window_size is not None:
                raise ValueError("--window-size is not implemented with FlexAttention for T5; use SDPA attention")
            if self.attention_dropout > 0:
                raise ValueError(f"FlexAttention has no attention dropout (--attention-dropout "
                                 f"{self.attention_dropout}); use --attention-dropout 0 or SDPA attention")

    def uses_flex_attention(self) -> bool:
        """Whether the model's full forward (``encode`` and ``decode``; incremental decoding always
        uses SDPA) runs its attention through FlexAttention: :func:`uses_flex_attention`."""
        return uses_flex_attention(self.attention_backend)

    @property
    def decoder_layers(self) -> int:
        assert self.decoder_num_layers is not None
        return self.decoder_num_layers


def uses_flex_attention(backend: str) -> bool:
    """Whether T5's attention runs through FlexAttention: with "flex" only. "auto" is SDPA for every
    layout: measured on one H200 (2026-12-03, T5-base in the HF layout, bf16, whole-model compile;
    benchmarks/RESULTS.md) FlexAttention with the relative bias as a score_mod, whose backward adds
    the bias gradient into the [heads, distances] table, took 94.0 ms per step against SDPA's 89.4 ms
    with the bias as a float mask."""
    return backend == "flex"


def attention_description(backend: str, position_embedding_type: str, device_type: str,
                          bias_gradient: str = "auto") -> str:
    """One line saying how training's attention runs (the note ``pretrain_t5.py`` prints)."""
    relative = position_embedding_type == "relative"
    if uses_flex_attention(backend):
        how = ("FlexAttention (torch.compile'd flex_attention; "
               + ("the relative position bias as a score_mod over a [heads, distances] table, " if relative else "")
               + "padding and causality as block masks)")
    elif relative:
        how = "SDPA with the relative position bias and the padding as one float mask [b, heads, s, s] per stack"
        if recomputes_bias_gradient(bias_gradient, torch.device(device_type)):
            how += " (no gradient; the bias gradient recomputed apart" + (
                ", by a Triton kernel)" if kernel_available(torch.device(device_type)) else ", in PyTorch)")
    else:
        how = "SDPA with boolean padding masks"
    return f"T5 attention (attention backend {backend} on {device_type}): {how}"


def recomputes_bias_gradient(bias_gradient: str, device: torch.device) -> bool:
    """Whether T5's SDPA path recomputes the bias gradient apart on ``device``: always with "recompute";
    with "auto" where the Triton kernel runs on a GPU (measured on one H100, 2026-12-07, T5-base: 92.2 ms
    a step against 94.1 with the mask's gradient; the same recomputation in PyTorch was slower, 99.1
    against 92.7, so without the kernel "auto" keeps the mask's own gradient)."""
    if bias_gradient == "auto":
        return device.type == "cuda" and kernel_available(device)
    return bias_gradient == "recompute"


def bias_gradient_from_env() -> str:
    """T5Config.bias_gradient from ``MEGATRAIN_T5_BIAS_GRADIENT`` (unset: the dataclass default); a
    value other than ``auto``, ``mask`` or ``recompute`` is an error at start-up."""
    value = os.environ.get(BIAS_GRADIENT_ENV, "").strip()
    if not value:
        return T5Config.bias_gradient
    if value not in BIAS_GRADIENTS:
        raise ValueError(f"{BIAS_GRADIENT_ENV} must be {', '.join(BIAS_GRADIENTS)}, got {value!r}")
    return value


def t5_config_from_args(args: argparse.Namespace, vocab_size: int) -> T5Config:
    """T5Config from Megatron-style flags (``pretrain_t5.py``, after ``prepare_t5_args`` filled
    ``--num-layers`` and ``--seq-length``); ``vocab_size`` is already padded."""
    return T5Config(**transformer_fields_from_args(args, vocab_size),
                    decoder_num_layers=getattr(args, "decoder_num_layers", None),
                    relative_attention_num_buckets=getattr(args, "relative_attention_num_buckets", 32),
                    relative_attention_max_distance=getattr(args, "relative_attention_max_distance", 128),
                    decoder_seq_length=getattr(args, "decoder_seq_length", None),
                    attention_backend=attention_backend_from_args(args),
                    bias_gradient=bias_gradient_from_env())
