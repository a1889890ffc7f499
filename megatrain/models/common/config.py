"""The typed shape of a transformer: what every family's shared blocks (attention, MLP, norms, rotary,
embeddings, the transformer layer) read. A family's config subclasses it and adds its own fields."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Union


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
    # --rotary-interleaved: RoPE rotates adjacent pairs (x0, x1), (x2, x3), ... instead of (x_i, x_{i+r/2})
    rotary_interleaved: bool = False
    # Llama 3.x RoPE scaling (Megatron's --use-rope-scaling, --rope-scaling-factor): the inverse
    # frequencies of the long wavelengths are divided by the factor, a band between them mixed
    # (megatrain.models.common.rope.llama3_scaled_inv_freq). Megatron fixes the other three at 1, 4 and
    # 8192; they are fields (megatrain's flags) because Hugging Face configs may carry other values.
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
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
    # ---- mixture of experts (Megatron's names and defaults; num_moe_experts None: a dense model) ----
    # Layer i's MLP is a MoELayer (megatrain.models.common.moe.layer) when is_moe_layer(i): every
    # moe_layer_freq-th layer (int), or where the 0/1 list says 1. See docs of --num-experts & co.
    num_moe_experts: int | None = None  # --num-experts
    moe_ffn_hidden_size: int | None = None  # each expert's MLP width; filled with ffn_hidden_size
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"  # or "sigmoid" / "sqrtsoftplus"
    moe_router_pre_softmax: bool = False  # softmax (sigmoid) before the top-k, not after
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None  # group-limited routing: experts in this many groups,
    moe_router_group_topk: int | None = None  # of which each token's top-k come from this many
    moe_router_dtype: str | None = None  # "fp32" / "fp64": the router's logits and scores in that dtype
    moe_input_jitter_eps: float | None = None  # training: router input times U(1-eps, 1+eps)
    # aux_loss | seq_aux_loss | global_aux_loss | none; a list combines several (one coefficient each)
    moe_router_load_balancing_type: Union[str, list[str]] = "aux_loss"
    moe_aux_loss_coeff: Union[float, list[float]] = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing (sigmoid scores)
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: float | None = None  # None: no token is dropped
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"  # or "position"
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_layer_freq: Union[int, list[int]] = 1
    moe_grouped_gemm: bool = False  # one grouped matmul over the local experts (a kernel choice)
    # Benchmarks only (Megatron's experimental flag): the router's logits replaced by random normal
    # ones (the gradient passes straight through), so the experts get balanced loads.
    moe_router_force_load_balancing: bool = False
    # ---- multi-latent attention (DeepSeek-V2/V3; Megatron's --multi-latent-attention and its MLA flags) ----
    # Queries from hidden (or through a rank-q_lora_rank bottleneck), keys and values from one shared
    # latent of kv_lora_rank dims; each head's query/key has qk_head_dim dims without positions and
    # qk_pos_emb_head_dim rotated ones (the key's shared by all heads), values v_head_dim
    # (megatrain.models.common.mla). kv_channels and num_query_groups do not apply.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # MLA's RoPE: "yarn" (Megatron's MLA default) or "rope"; YaRN's factor, mscales and the fields
    # Megatron's MLA config fixes (original context 4096, beta_fast 32, beta_slow 1) but Hugging Face
    # configs carry.
    rope_type: str | None = None  # None: "yarn" with multi-latent attention (set by its check)
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    # ---- multi-token prediction (DeepSeek-V3; Megatron's --mtp-num-layers, --mtp-loss-scaling-factor) ----
    # mtp_num_layers extra depths after the decoder, each predicting one token further
    # (megatrain.models.gpt.mtp); their layer takes the decoder's last layer's kind (dense or MoE), so
    # is_moe_layer(i) for i >= num_layers is the last layer's. 0: none.
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    mtp_use_repeated_layer: bool = False  # one depth's modules run mtp_num_layers times (Megatron's)
    mtp_detach_heads: bool = False  # the depths' loss trains the depths alone (inputs and output weight detached)
    # Self-attention sees earlier positions only (decoders); False: every position of the sequence
    # (encoders), unless an explicit mask says otherwise. A property of the family, not a field.
    causal_attention: ClassVar[bool] = True
    # The --position-embedding-type values the family's model implements.
    position_embedding_types: ClassVar[tuple[str, ...]] = ("learned_absolute", "rope")
    # Whether the family's model builds multi-latent attention (GPT does; BERT, T5 and LLaVA do not).
    supports_mla: ClassVar[bool] = False
    # Whether the family's model builds multi-token prediction layers (GPT does).
    supports_mtp: ClassVar[bool] = False

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
        if self.position_embedding_type == "rope" and not self.multi_latent_attention and (
                self.rotary_dim % 2 or self.rotary_dim == 0):
            raise ValueError(f"rotary embeddings need an even number of rotated dims: --kv-channels "
                             f"({self.kv_channels}) x --rotary-percent ({self.rotary_percent}) = {self.rotary_dim}")
        if self.rotary_interleaved and self.position_embedding_type != "rope":
            raise ValueError(f"--rotary-interleaved lays out rotary embeddings: it needs --position-embedding-type "
                             f"rope, got {self.position_embedding_type}")
        self._check_rope_scaling()
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
        self._check_moe()
        self._check_mtp()
        if self.multi_latent_attention:
            from megatrain.models.common.mla_config import check_mla_config

            check_mla_config(self)

    def _check_mtp(self) -> None:
        if not self.mtp_num_layers:
            return
        if self.mtp_num_layers < 0:
            raise ValueError(f"--mtp-num-layers must be at least 0, got {self.mtp_num_layers}")
        if not type(self).supports_mtp:
            raise ValueError("--mtp-num-layers: multi-token prediction is built for the GPT family's decoder only")
        if self.position_embedding_type not in ("rope", "none"):
            raise ValueError(f"--mtp-num-layers needs --position-embedding-type rope or none (as in Megatron-LM: the "
                             f"next tokens' embeddings carry no positions), got {self.position_embedding_type}")
        if self.mtp_loss_scaling_factor < 0:
            raise ValueError(f"--mtp-loss-scaling-factor must be at least 0, got {self.mtp_loss_scaling_factor}")

    def _check_rope_scaling(self) -> None:
        if not self.use_rope_scaling:
            return
        if self.position_embedding_type != "rope":
            raise ValueError(f"--use-rope-scaling scales rotary embeddings: it needs --position-embedding-type rope, "
                             f"got {self.position_embedding_type!r}")
        low, high = self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor
        if not self.rope_scaling_factor > 0:
            raise ValueError(f"--rope-scaling-factor must be positive, got {self.rope_scaling_factor}")
        if not 0 < low < high:
            raise ValueError(f"--rope-scaling-low-freq-factor ({low}) must be positive and below "
                             f"--rope-scaling-high-freq-factor ({high})")
        context = self.rope_scaling_original_max_position_embeddings
        if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
            raise ValueError(f"--rope-scaling-original-max-position-embeddings must be a positive integer, "
                             f"got {context!r}")

    # ---- mixture of experts ------------------------------------------------------------------------
    moe_balancing_types: ClassVar[tuple[str, ...]] = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
    # Whether the family's model builds MoE layers (BERT and T5 do not).
    supports_moe: ClassVar[bool] = True

    def _check_moe(self) -> None:
        """Megatron's checks of the MoE settings (TransformerConfig.__post_init__ and arguments.py)."""
        if self.num_moe_experts is None:
            if self.moe_ffn_hidden_size is not None:
                raise ValueError("--moe-ffn-hidden-size is set but --num-experts is not (a dense model)")
            return
        if not self.supports_moe:
            raise ValueError(f"--num-experts: the {type(self).__name__.removesuffix('Config')} family has no "
                             "mixture-of-experts layers (MoE models are GPT-family models: pretrain_gpt.py)")
        e = self.num_moe_experts
        if isinstance(e, bool) or not isinstance(e, int) or e <= 0:
            raise ValueError(f"--num-experts must be a positive integer, got {e!r}")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.moe_ffn_hidden_size <= 0:
            raise ValueError(f"--moe-ffn-hidden-size must be positive, got {self.moe_ffn_hidden_size}")
        k = self.moe_router_topk
        if not 1 <= k <= e:
            raise ValueError(f"--moe-router-topk must be between 1 and --num-experts ({e}), got {k}")
        if self.moe_router_score_function not in ("softmax", "sigmoid", "sqrtsoftplus"):
            raise ValueError(f"--moe-router-score-function must be softmax, sigmoid or sqrtsoftplus, "
                             f"got {self.moe_router_score_function!r}")
        if k == 1 and self.moe_router_score_function == "softmax" and not self.moe_router_pre_softmax:
            # a softmax over the one selected logit is 1 whatever the logit: no gradient reaches the router
            raise ValueError("--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax "
                             "(a softmax over one selected logit has no gradient), as in Megatron-LM")
        if self.moe_router_topk_scaling_factor is not None and self.moe_router_topk_scaling_factor <= 0:
            raise ValueError(f"--moe-router-topk-scaling-factor must be positive, "
                             f"got {self.moe_router_topk_scaling_factor}")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if groups is not None and groups <= 0:
            raise ValueError(f"--moe-router-num-groups must be positive, got {groups}")
        if group_topk is not None:
            if groups is None:
                raise ValueError("--moe-router-group-topk (group-limited routing) needs --moe-router-num-groups")
            if e % groups:
                raise ValueError(f"--num-experts ({e}) must be divisible by --moe-router-num-groups ({groups})")
            if not 1 <= group_topk <= groups:
                raise ValueError(f"--moe-router-group-topk must be between 1 and --moe-router-num-groups "
                                 f"({groups}), got {group_topk}")
            if k % group_topk or k // group_topk > e // groups:
                raise ValueError(f"--moe-router-topk ({k}) must be a multiple of --moe-router-group-topk "
                                 f"({group_topk}) and at most {group_topk} x the {e // groups} experts of a group "
                                 "(each chosen group gives topk / group-topk experts)")
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            raise ValueError(f"--moe-router-dtype must be fp32 or fp64, got {self.moe_router_dtype!r}")
        if self.moe_input_jitter_eps is not None and not 0.0 <= self.moe_input_jitter_eps < 1.0:
            raise ValueError(f"--moe-input-jitter-eps must be in [0, 1), got {self.moe_input_jitter_eps}")
        self._check_balancing()
        if self.moe_router_enable_expert_bias and self.moe_router_score_function == "softmax":
            raise ValueError("--moe-router-enable-expert-bias (aux-loss-free balancing) needs "
                             "--moe-router-score-function sigmoid or sqrtsoftplus, as in Megatron-LM")
        if self.moe_expert_capacity_factor is not None:
            if self.moe_expert_capacity_factor < 0:  # Megatron: a negative factor means dropless
                self.moe_expert_capacity_factor = None
            elif self.moe_expert_capacity_factor == 0:
                raise ValueError("--moe-expert-capacity-factor must be positive (or negative / unset: no "
                                 "token dropping), got 0")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        if self.moe_token_drop_policy not in ("probs", "position"):
            raise ValueError(f"--moe-token-drop-policy must be probs or position, got {self.moe_token_drop_policy!r}")
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and shared <= 0:
            raise ValueError(f"--moe-shared-expert-intermediate-size must be positive, got {shared}")
        if self.moe_shared_expert_gate and shared is None:
            raise ValueError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
        self.moe_layer_freq = check_moe_layer_freq(self.moe_layer_freq, self.num_layers)

    def _check_balancing(self) -> None:
        types, coeffs = self.moe_router_load_balancing_type, self.moe_aux_loss_coeff
        if isinstance(types, (list, tuple)) and len(types) == 1:
            types = types[0]
        if isinstance(coeffs, (list, tuple)) and len(coeffs) == 1:
            coeffs = coeffs[0]
        names = [types] if isinstance(types, str) else list(types)
        for t in names:
            if t in ("sinkhorn", "quantile_balancing"):
                raise ValueError(f"--moe-router-load-balancing-type {t} is not supported (aux_loss, seq_aux_loss, "
                                 "global_aux_loss, none, or --moe-router-enable-expert-bias for aux-loss-free "
                                 "balancing)")
            if t not in self.moe_balancing_types:
                raise ValueError(f"--moe-router-load-balancing-type must be one of "
                                 f"{', '.join(self.moe_balancing_types)}, got {t!r}")
        if isinstance(types, str):
            if not isinstance(coeffs, (int, float)) or isinstance(coeffs, bool):
                raise ValueError(f"--moe-aux-loss-coeff: one coefficient for one --moe-router-load-balancing-type, "
                                 f"got {coeffs!r}")
            coeff_list = [float(coeffs)]
        else:
            if len(set(names)) != len(names):
                raise ValueError(f"--moe-router-load-balancing-type names a type twice: {names}")
            if not isinstance(coeffs, (list, tuple)) or len(coeffs) != len(names):
                raise ValueError(f"--moe-aux-loss-coeff needs one coefficient per --moe-router-load-balancing-type "
                                 f"({len(names)}), got {coeffs!r}")
            coeff_list = [float(c) for c in coeffs]
            types, coeffs = list(names), coeff_list
        if any(c < 0 for c in coeff_list):
            raise ValueError(f"--moe-aux-loss-coeff must be >= 0, got {coeffs}")
        if self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0:
            raise ValueError(f"--moe-z-loss-coeff must be >= 0, got {self.moe_z_loss_coeff}")
        self.moe_router_load_balancing_type = types
        self.moe_aux_loss_coeff = coeffs if isinstance(coeffs, list) else float(coeffs)

    def aux_loss_coeff(self, balancing_type: str) -> float:
        """The coefficient of one balancing loss (0.0 when that type is not chosen), as Megatron's
        ``get_aux_loss_coeff``."""
        types, coeffs = self.moe_router_load_balancing_type, self.moe_aux_loss_coeff
        if isinstance(types, str):
            return float(coeffs) if types == balancing_type else 0.0  # type: ignore[arg-type]
        return float(coeffs[types.index(balancing_type)]) if balancing_type in types else 0.0  # type: ignore[index]

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` (0-based) has a mixture-of-experts MLP; ``i >= num_layers``: multi-token
        prediction's layer ``i - num_layers``, of the last layer's kind (Megatron's)."""
        if self.num_moe_experts is None:
            return False
        i = min(i, self.num_layers - 1)
        freq = self.moe_layer_freq
        return bool(freq[i]) if isinstance(freq, list) else i % freq == 0

    @property
    def num_moe_layers(self) -> int:
        """The decoder's number of MoE layers (all pipeline stages together)."""
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def mtp_built_layers(self) -> int:
        """Multi-token prediction's depth modules: one with --mtp-use-repeated-layer, else one per depth."""
        return min(self.mtp_num_layers, 1) if self.mtp_use_repeated_layer else self.mtp_num_layers

    @property
    def mtp_moe_layers(self) -> int:
        """Multi-token prediction's MoE layers as built (each depth's layer is of the last layer's kind)."""
        return self.mtp_built_layers if self.mtp_num_layers and self.is_moe_layer(self.num_layers - 1) else 0

    @property
    def moe_ffn(self) -> int:
        """Each routed expert's MLP width (--moe-ffn-hidden-size, else --ffn-hidden-size)."""
        assert self.ffn_hidden_size is not None
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_hidden_size

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


def check_moe_layer_freq(freq: Any, num_layers: int) -> int | list[int]:
    """``freq`` (an int N >= 1, a 0/1 list of ``num_layers`` entries, or the flag's text) checked;
    a list read back from JSON stays a list. ValueError naming --moe-layer-freq otherwise."""
    if isinstance(freq, str):
        freq = parse_moe_layer_freq(freq)
    if isinstance(freq, tuple):
        freq = list(freq)
    if isinstance(freq, bool) or not isinstance(freq, (int, list)):
        raise ValueError(f"--moe-layer-freq must be an integer or a list of 0/1, got {freq!r}")
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"--moe-layer-freq must be >= 1, got {freq}")
        return freq
    if any(isinstance(v, bool) or v not in (0, 1) for v in freq):
        raise ValueError(f"--moe-layer-freq: a pattern holds 0 (dense layer) and 1 (MoE layer) only, got {freq}")
    if len(freq) != num_layers:
        raise ValueError(f"--moe-layer-freq: the pattern has {len(freq)} entries but --num-layers is {num_layers}")
    return [int(v) for v in freq]


_FREQ_TOKEN = re.compile(r"\s*(?:([0-9]+)|(.))", re.DOTALL)


def parse_moe_layer_freq(text: str) -> int | list[int]:
    """Megatron's --moe-layer-freq value without ``eval``: an integer N, or a list expression made of
    ``[a, b, ...]`` (integers), ``(...)``, ``*`` by an integer (either side) and ``+`` (concatenation),
    e.g. ``([0]*3+[1]*29)`` or ``([1]*3+[0])*2``. ValueError naming the flag for anything else."""
    text = str(text).strip()
    tokens: list[tuple[str, Any]] = []
    pos = 0
    while pos < len(text):
        m = _FREQ_TOKEN.match(text, pos)
        assert m is not None  # the text is stripped: something follows any spaces
        if m.group(1) is not None:
            tokens.append(("int", int(m.group(1))))
        elif m.group(2) in "[](),*+":
            tokens.append((m.group(2), None))
        elif not m.group(2).isspace():
            raise ValueError(f"--moe-layer-freq: unexpected {m.group(2)!r} in {text!r} (expected an integer or "
                             "a list expression such as ([0]*3+[1]*29))")
        pos = m.end()
    if len(tokens) > 10000:
        raise ValueError(f"--moe-layer-freq: expression too long ({len(text)} characters)")
    at = 0

    def fail(what: str) -> ValueError:
        return ValueError(f"--moe-layer-freq: {what} in {text!r} (expected an integer or a list expression "
                          "such as ([0]*3+[1]*29))")

    def peek() -> str | None:
        return tokens[at][0] if at < len(tokens) else None

    def take(kind: str) -> Any:
        nonlocal at
        if peek() != kind:
            raise fail(f"expected {kind!r}" if kind != "int" else "expected an integer")
        at += 1
        return tokens[at - 1][1]

    def expr(depth: int) -> Any:  # term ('+' term)*
        value = term(depth)
        while peek() == "+":
            take("+")
            right = term(depth)
            if isinstance(value, int) != isinstance(right, int):
                raise fail("'+' between a list and an integer")
            value = value + right
        return value

    def term(depth: int) -> Any:  # atom ('*' atom)*
        value = atom(depth)
        while peek() == "*":
            take("*")
            right = atom(depth)
            if isinstance(value, list) and isinstance(right, list):
                raise fail("a list times a list")
            if isinstance(value, list) or isinstance(right, list):
                count = right if isinstance(value, list) else value
                if count > 100000 or len(value if isinstance(value, list) else right) * count > 100000:
                    raise fail("a pattern longer than 100000 layers")
            value = value * right
        return value

    def atom(depth: int) -> Any:
        if depth > 50:
            raise fail("nesting too deep")
        kind = peek()
        if kind == "int":
            return take("int")
        if kind == "(":
            take("(")
            value = expr(depth + 1)
            take(")")
            return value
        if kind == "[":
            take("[")
            items: list[int] = []
            while peek() != "]":
                items.append(take("int"))
                if peek() == ",":
                    take(",")
                elif peek() != "]":
                    raise fail("expected ',' or ']'")
            take("]")
            return items
        raise fail("unexpected end" if kind is None else f"unexpected {kind!r}")

    if not tokens:
        raise fail("empty value")
    value = expr(0)
    if at != len(tokens):
        raise fail(f"unexpected {tokens[at][0]!r}")
    return value


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
        rotary_interleaved=bool(getattr(args, "rotary_interleaved", False)),
        use_rope_scaling=bool(getattr(args, "use_rope_scaling", False)),
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
        rope_scaling_low_freq_factor=getattr(args, "rope_scaling_low_freq_factor", 1.0),
        rope_scaling_high_freq_factor=getattr(args, "rope_scaling_high_freq_factor", 4.0),
        rope_scaling_original_max_position_embeddings=getattr(args, "rope_scaling_original_max_position_embeddings",
                                                              8192),
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
        mtp_num_layers=getattr(args, "mtp_num_layers", None) or 0,
        mtp_loss_scaling_factor=getattr(args, "mtp_loss_scaling_factor", 0.1),
        mtp_use_repeated_layer=bool(getattr(args, "mtp_use_repeated_layer", False)),
        mtp_detach_heads=bool(getattr(args, "mtp_detach_heads", False)),
        **moe_fields_from_args(args),
        **mla_fields_from_args(args),
    )


def mla_fields_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The multi-latent-attention fields from Megatron's flags (``--rope-type`` unset: YaRN for MLA, as
    Megatron's MLA config)."""
    if not getattr(args, "multi_latent_attention", False):
        rope_type = getattr(args, "rope_type", None)
        if rope_type not in (None, "rope"):
            raise ValueError(f"--rope-type {rope_type} is for --multi-latent-attention only (other attention "
                             f"takes rope)")
        return {}
    return dict(
        multi_latent_attention=True,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        rope_type=args.rope_type or "yarn",
        rotary_scaling_factor=args.rotary_scaling_factor,
        mscale=args.mscale,
        mscale_all_dim=args.mscale_all_dim,
        **{name: value for name, value in (
            ("yarn_original_max_position_embeddings", getattr(args, "yarn_original_max_position_embeddings", None)),
            ("yarn_beta_fast", getattr(args, "yarn_beta_fast", None)),
            ("yarn_beta_slow", getattr(args, "yarn_beta_slow", None))) if value is not None},
    )


def moe_fields_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The mixture-of-experts fields of :class:`TransformerConfig` from Megatron's flags (``--num-experts
    0`` means none, as Megatron; a list of one balancing type / coefficient is that one)."""
    def get(name: str, default: Any) -> Any:
        return getattr(args, name, default)

    experts = get("num_experts", None)
    types = get("moe_router_load_balancing_type", "aux_loss")
    coeffs = get("moe_aux_loss_coeff", 0.0)
    return dict(
        num_moe_experts=experts or None,
        moe_ffn_hidden_size=get("moe_ffn_hidden_size", None),
        moe_router_topk=get("moe_router_topk", 2),
        moe_router_score_function=get("moe_router_score_function", "softmax"),
        moe_router_pre_softmax=bool(get("moe_router_pre_softmax", False)),
        moe_router_topk_scaling_factor=get("moe_router_topk_scaling_factor", None),
        moe_router_num_groups=get("moe_router_num_groups", None),
        moe_router_group_topk=get("moe_router_group_topk", None),
        moe_router_dtype=get("moe_router_dtype", None),
        moe_input_jitter_eps=get("moe_input_jitter_eps", None),
        moe_router_load_balancing_type=types[0] if isinstance(types, list) and len(types) == 1 else types,
        moe_aux_loss_coeff=coeffs[0] if isinstance(coeffs, list) and len(coeffs) == 1 else coeffs,
        moe_z_loss_coeff=get("moe_z_loss_coeff", None),
        moe_router_enable_expert_bias=bool(get("moe_router_enable_expert_bias", False)),
        moe_router_bias_update_rate=get("moe_router_bias_update_rate", 1e-3),
        moe_expert_capacity_factor=get("moe_expert_capacity_factor", None),
        moe_pad_expert_input_to_capacity=bool(get("moe_pad_expert_input_to_capacity", False)),
        moe_token_drop_policy=get("moe_token_drop_policy", "probs"),
        moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size", None),
        moe_shared_expert_gate=bool(get("moe_shared_expert_gate", False)),
        moe_layer_freq=get("moe_layer_freq", 1),
        moe_grouped_gemm=bool(get("moe_grouped_gemm", False)),
        moe_router_force_load_balancing=bool(get("moe_router_force_load_balancing", False)),
    )
