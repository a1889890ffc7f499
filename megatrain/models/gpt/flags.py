"""The GPT family's flags, with Megatron-LM's names, defaults and attribute names.

The model shape (``network size``), its dropout (``regularization``) and the initialisation scale
(``initialization``); `megatrain.models.gpt.config.gpt_config_from_args` turns them into a
`GPTConfig`, which checks them.
"""

from __future__ import annotations

import argparse

from megatrain.flags import flag_section
from megatrain.models.common.config import parse_moe_layer_freq

__all__ = ["add_gpt_flags", "add_moe_flags", "add_mla_flags", "add_mtp_flags"]


def _window(text: str) -> tuple[int, int]:
    """Megatron's --window-size value: LEFT,RIGHT (e.g. 4095,0)."""
    try:
        left, right = (int(part) for part in text.replace("(", "").replace(")", "").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (two integers, e.g. 4095,0), got {text!r}") from None
    return left, right


def _moe_layer_freq(text: str) -> int | list[int]:
    """Megatron's --moe-layer-freq: N, or a list expression such as ([0]*3+[1]*29) (parsed, not eval'd)."""
    try:
        return parse_moe_layer_freq(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--moe-layer-freq: ")) from None


def add_moe_flags(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's mixture-of-experts model flags (names, defaults and attribute names as its
    ``TransformerConfig``-generated flags); `TransformerConfig` checks them. The expert-parallel
    sizes and the token dispatcher are parallel settings (megatrain.parallel.flags)."""
    g = flag_section(parser, "mixture of experts")
    g.add_argument("--num-experts", type=int, default=None,
                   help="routed experts per MoE layer (unset or 0: a dense model)")
    g.add_argument("--moe-layer-freq", type=_moe_layer_freq, default=1,
                   help="which layers are MoE layers: N (layers 0, N, 2N, ...) or a 0/1 pattern of --num-layers "
                        "entries as a list expression, e.g. \"([0]*1+[1]*23)\" (1: MoE, 0: dense)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's MLP hidden size (default --ffn-hidden-size)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="hidden size of the shared expert MLP every token passes through (all shared experts "
                        "together); unset: none")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="scale the shared experts' output by sigmoid(x . w) (Qwen2-MoE)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    g.add_argument("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid", "sqrtsoftplus"],
                   help="router scores: softmax, sigmoid or sqrt(softplus) (the last two normalised over the "
                        "chosen experts when topk > 1)")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="apply the score function over all experts before choosing the top-k (by default, "
                        "softmax scores are a softmax over the chosen logits)")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="multiply the chosen experts' weights by this (DeepSeek's routed scaling factor)")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="group-limited routing: the experts form this many equal groups ...")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="... of which each token's experts come from the best this many (a group's score: the "
                        "sum of its top topk/group-topk scores)")
    g.add_argument("--moe-router-dtype", default=None, choices=["fp32", "fp64"],
                   help="compute the router's logits, scores and expert weights in this dtype (default: the "
                        "input's)")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none"],
                   help="balancing loss: aux_loss (Switch/GShard, per micro-batch), seq_aux_loss (per sequence, "
                        "DeepSeek), global_aux_loss (over the global batch), none; several combine, each with its "
                        "--moe-aux-loss-coeff (sinkhorn and quantile_balancing are refused)")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0,
                   help="coefficient of the balancing loss (1e-2 is a usual start); one per balancing type")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="coefficient of the router z-loss, mean of logsumexp(logits)^2 (1e-3 is a usual start)")
    g.add_argument("--moe-input-jitter-eps", type=float, default=None,
                   help="in training, multiply the router's input by uniform noise in [1-eps, 1+eps]")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the scores for the "
                        "choice only, moves by --moe-router-bias-update-rate after each step towards balance")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="step of the expert bias update: bias += rate * sign(mean load - load)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="each expert takes at most factor x tokens x topk / experts tokens of a micro-batch, the "
                        "rest are dropped (unset: no token is dropped)")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="pad each expert's input to its capacity (with --moe-expert-capacity-factor)")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"],
                   help="beyond capacity, drop the tokens of lowest routing weight (probs) or the last ones (position)")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="run the local experts as one grouped matmul (torch._grouped_mm where available)")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="benchmarks only: random router logits (gradient passed straight through), so that "
                        "every expert gets about the same load")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="also write each MoE layer's balancing loss and z-loss to TensorBoard (moe/<name>_layer_<i>)")


def add_mla_flags(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's multi-latent attention flags (DeepSeek-V2/V3), with its names and defaults;
    `TransformerConfig` (megatrain.models.common.mla_config) checks them."""
    g = flag_section(parser, "multi-latent attention")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek's multi-latent attention: keys and values from one low-rank latent per token, "
                        "queries optionally through their own (see docs/moe.md)")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="rank of the queries' low-rank projection (unset: queries projected from the hidden "
                        "state directly)")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="rank of the shared key/value latent")
    g.add_argument("--qk-head-dim", type=int, default=128,
                   help="query/key dims per head without positions (a head's query has --qk-head-dim + "
                        "--qk-pos-emb-head-dim)")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                   help="query/key dims per head that RoPE rotates (the key's are shared by every head)")
    g.add_argument("--v-head-dim", type=int, default=128, help="value dims per head")
    g.add_argument("--rope-type", default=None, choices=["rope", "yarn"],
                   help="multi-latent attention's RoPE: yarn (the default with --multi-latent-attention) or rope; "
                        "other attention takes rope only")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="YaRN's context scaling factor (1: plain RoPE frequencies)")
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN's mscale (the cos/sin concentration)")
    g.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help="YaRN's mscale_all_dim (also scales the softmax: by mscale(factor, this)^2)")
    g.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                   help="YaRN's original context length (default 4096, what Megatron-LM's MLA fixes)")
    g.add_argument("--yarn-beta-fast", type=float, default=None,
                   help="YaRN's beta_fast: dim pairs turning more often over the original context keep their "
                        "frequency (default 32)")
    g.add_argument("--yarn-beta-slow", type=float, default=None,
                   help="YaRN's beta_slow: dim pairs turning fewer times are slowed by the factor (default 1)")


def add_mtp_flags(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's multi-token prediction flags (DeepSeek-V3), with its names and defaults."""
    g = flag_section(parser, "multi-token prediction")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="multi-token prediction depths after the decoder, each a layer of the last layer's kind "
                        "that predicts one token further (DeepSeek-V3); their loss trains the model, the logged "
                        "lm loss stays the next token's (see docs/models/gpt.md)")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="the depths' losses, averaged over the depths, enter the gradient times this factor")
    g.add_argument("--mtp-use-repeated-layer", action="store_true",
                   help="one depth's modules (mtp.layers.0) run --mtp-num-layers times instead of one set per depth")
    g.add_argument("--mtp-detach-heads", action="store_true",
                   help="the depths' loss trains the depths alone: their hidden-state and embedding inputs and the "
                        "output weight they use are detached from the model")


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
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="RoPE rotates adjacent dim pairs (x0, x1), (x2, x3), ... instead of the two halves of the "
                        "rotated dims (Hugging Face's LLaMA layout, the default)")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.x RoPE scaling: the long-wavelength inverse frequencies divided by "
                        "--rope-scaling-factor, a band between long and short ones interpolated (Hugging Face's "
                        "rope_type llama3)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="the Llama 3.x RoPE scaling factor (with --use-rope-scaling)")
    g.add_argument("--rope-scaling-low-freq-factor", type=float, default=1.0,
                   help="megatrain extension: Llama 3.x scaling's low_freq_factor (wavelengths above original "
                        "context / this are divided by the factor); Megatron-LM fixes it at 1")
    g.add_argument("--rope-scaling-high-freq-factor", type=float, default=4.0,
                   help="megatrain extension: Llama 3.x scaling's high_freq_factor (wavelengths below original "
                        "context / this stay); Megatron-LM fixes it at 4")
    g.add_argument("--rope-scaling-original-max-position-embeddings", type=int, default=8192,
                   help="megatrain extension: the context length the Llama 3.x scaling refers to (Hugging Face's "
                        "original_max_position_embeddings); Megatron-LM fixes it at 8192")
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
    add_moe_flags(parser)
    add_mla_flags(parser)
    add_mtp_flags(parser)
