"""The typed shape of a transformer: what every family's shared blocks (attention, MLP, norms, rotary,
embeddings, the transformer layer) read. A family's config subclasses it and adds its own fields."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class TransformerConfig:
    """Shape and style of a stack of transformer layers.

    Field names follow Megatron-LM's flags (``--num-layers`` -> ``num_layers``).
    ``vocab_size`` is the *padded* vocabulary size the embedding is built with.
    """

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 256
    max_position_embeddings: int = 1024
    ffn_hidden_size: int | None = None  # default 4*h (GELU) or Megatron's SwiGLU default
    kv_channels: int | None = None  # head dim; default h // n
    num_query_groups: int | None = None  # None means n (no grouped-query attention)
    position_embedding_type: str = "learned_absolute"  # or "rope" (T5 adds "relative")
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # fraction of each head's dims that rotate (the rest pass through)
    normalization: str = "LayerNorm"  # or "RMSNorm"
    norm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False  # norm weights stored zero-centred: the scale is 1 + weight
    swiglu: bool = False
    # The GELU MLP's activation: "none" = exact (erf) GELU, "tanh" = its tanh approximation (what
    # Megatron-LM's default fused bias-GELU computes, and GPT-2's "gelu_new").
    gelu_approximation: str = "none"
    add_bias_linear: bool = True
    # A bias on the QKV projection even without the other linear biases (Megatron's --add-qkv-bias;
    # with add_bias_linear it has one anyway): Qwen2's attention.
    add_qkv_bias: bool = False
    # RMSNorm (or LayerNorm, as --normalization) over each head's queries and keys before RoPE
    # (Megatron's --qk-layernorm: self_attention.q_layernorm / k_layernorm, width kv_channels): Qwen3's.
    qk_layernorm: bool = False
    # Sliding-window attention (Megatron's --window-size LEFT,RIGHT; Transformer Engine's and flash
    # attention's convention): query i attends to keys i - LEFT ... i + RIGHT (-1: unbounded), within
    # the causal rule for decoders. None: full attention. Hugging Face's sliding_window W is (W - 1, 0).
    window_size: tuple[int, int] | None = None
    untie_embeddings_and_output_weights: bool = False
    # Under autocast the residual stream between layers is in the autocast dtype (Megatron's default);
    # True keeps it in float32 (--fp32-residual-connection).
    fp32_residual_connection: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    # Self-attention sees earlier positions only (decoders); False: every position of the sequence
    # (encoders), unless an explicit mask says otherwise. A property of the family, not a field.
    causal_attention: ClassVar[bool] = True
    # The --position-embedding-type values the family's model implements.
    position_embedding_types: ClassVar[tuple[str, ...]] = ("learned_absolute", "rope")

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"--hidden-size ({self.hidden_size}) must be divisible by "
                    f"--num-attention-heads ({self.num_attention_heads}) unless --kv-channels is given"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.kv_channels <= 0:
            raise ValueError(f"--kv-channels must be positive, got {self.kv_channels}")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_query_groups <= 0:
            raise ValueError(f"--num-query-groups must be positive, got {self.num_query_groups}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                f"--num-query-groups ({self.num_query_groups})"
            )
        if self.ffn_hidden_size is None:
            if self.swiglu:
                # Megatron: int((4h * 2/3) / 64) * 64
                self.ffn_hidden_size = int((4 * self.hidden_size * 2 / 3) / 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.position_embedding_type not in self.position_embedding_types:
            raise ValueError(f"--position-embedding-type must be {' or '.join(self.position_embedding_types)}, "
                             f"got {self.position_embedding_type!r}")
        if self.gelu_approximation not in ("none", "tanh"):
            raise ValueError(f"gelu_approximation must be none or tanh, got {self.gelu_approximation!r}")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization must be LayerNorm or RMSNorm, got {self.normalization!r}")
        if self.ffn_hidden_size <= 0:
            raise ValueError(
                f"--ffn-hidden-size must be positive, got {self.ffn_hidden_size}"
                + (" (the SwiGLU default needs --hidden-size >= 24)" if self.swiglu else "")
            )
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.position_embedding_type == "rope" and (self.rotary_dim % 2 or self.rotary_dim == 0):
            raise ValueError(f"rotary embeddings need an even number of rotated dims: --kv-channels "
                             f"({self.kv_channels}) x --rotary-percent ({self.rotary_percent}) = {self.rotary_dim}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if self.window_size is not None:
            window = tuple(self.window_size)
            if len(window) != 2 or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1
                                           for w in window):
                raise ValueError(f"--window-size must be two integers LEFT,RIGHT, each >= -1 (-1: unbounded), "
                                 f"got {self.window_size!r}")
            self.window_size = window  # a list when read back from a checkpoint's meta.json
        if self.init_method_std <= 0:
            raise ValueError(f"--init-method-std must be positive, got {self.init_method_std}")

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (Megatron: int(kv_channels * rotary_percent))."""
        assert self.kv_channels is not None
        return int(self.kv_channels * self.rotary_percent)

    @property
    def head_dim(self) -> int:
        assert self.kv_channels is not None
        return self.kv_channels

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head (n / g); the same on every tensor-parallel rank."""
        assert self.num_query_groups is not None
        return self.num_attention_heads // self.num_query_groups


def gelu_approximation_from_args(args: argparse.Namespace) -> str:
    """Megatron-LM's GELU: with linear biases its default fused bias-GELU computes the tanh
    approximation; ``--no-bias-gelu-fusion`` (or no biases) gives exact GELU."""
    fused = getattr(args, "add_bias_linear", True) and not getattr(args, "no_bias_gelu_fusion", False)
    return "tanh" if fused and not args.swiglu else "none"


def transformer_fields_from_args(args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    """Every :class:`TransformerConfig` field from Megatron-style flags (``vocab_size`` already padded):
    what a family's ``config_from_args`` starts from."""
    return dict(
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
        add_qkv_bias=bool(getattr(args, "add_qkv_bias", False)),
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        window_size=getattr(args, "window_size", None),
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        fp32_residual_connection=bool(getattr(args, "fp32_residual_connection", False)),
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
    )
