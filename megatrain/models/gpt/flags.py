"""The GPT family's flags, with Megatron-LM's names, defaults and attribute names.

The model shape (``network size``), its dropout (``regularization``) and the initialisation scale
(``initialization``); `megatrain.models.gpt.config.gpt_config_from_args` turns them into a
`GPTConfig`, which checks them.
"""

from __future__ import annotations

import argparse

from megatrain.flags import flag_section

__all__ = ["add_gpt_flags"]


def _window(text: str) -> tuple[int, int]:
    """Megatron's --window-size value: LEFT,RIGHT (e.g. 4095,0)."""
    try:
        left, right = (int(part) for part in text.replace("(", "").replace(")", "").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (two integers, e.g. 4095,0), got {text!r}") from None
    return left, right


def add_gpt_flags(parser: argparse.ArgumentParser) -> None:
    """Add the model-shape, dropout and initialisation flags of the GPT family to ``parser``."""
    g = flag_section(parser, "network size")
    g.add_argument("--num-layers", type=int, default=None, help="number of transformer layers")
    g.add_argument("--hidden-size", type=int, default=None, help="transformer hidden size")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP hidden size (default 4*hidden, or Megatron's SwiGLU default)")
    g.add_argument("--num-attention-heads", type=int, default=None, help="attention heads")
    g.add_argument("--kv-channels", type=int, default=None, help="head dimension (default hidden/heads)")
    g.add_argument("--group-query-attention", action="store_true", help="use grouped-query attention")
    g.add_argument("--num-query-groups", type=int, default=1, help="query groups with --group-query-attention")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="maximum sequence length for learned positions (default --seq-length)")
    g.add_argument("--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope"])
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="no learned absolute positions (with --position-embedding-type rope there are none anyway)")
    g.add_argument("--rotary-base", type=float, default=10000.0, help="RoPE base period")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of each head's dims that RoPE rotates (the rest pass through)")
    g.add_argument("--fp32-residual-connection", action="store_true",
                   help="keep the residual stream between layers in float32 under bf16/fp16 (default: in the "
                        "half-precision dtype, as Megatron-LM)")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="store norm weights centred on zero; the layers scale by 1 + weight")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this (times TP)")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--layernorm-epsilon", type=float, default=None, help="old name of --norm-epsilon")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (LLaMA style)")
    g.add_argument("--no-bias-gelu-fusion", action="store_true",
                   help="exact (erf) GELU in the MLP; by default, as Megatron-LM's fused bias-GELU, the GELU "
                        "of a model with linear biases is the tanh approximation (torch.compile fuses it)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="no biases in linear layers")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="a bias on the QKV projection only, also with --disable-bias-linear (Qwen2)")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalise each head's queries and keys (--normalization, width --kv-channels) "
                        "before RoPE (Qwen3)")
    g.add_argument("--window-size", type=_window, default=None, metavar="LEFT,RIGHT",
                   help="sliding-window attention: query i sees keys i-LEFT..i+RIGHT (-1: unbounded; decoders "
                        "also stay causal); Hugging Face's sliding_window W is W-1,0 (Mistral)")
    g.add_argument("--seq-length", type=int, default=None, help="sequence length")
    g = flag_section(parser, "regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g = flag_section(parser, "initialization")
    g.add_argument("--init-method-std", type=float, default=0.02)
