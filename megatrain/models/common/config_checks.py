"""`ConfigCheck`: how one model-config field is compared between a checkpoint and the flags.

A family gives one per field of its config (``ModelFamily.config_checks``); the checkpoint code
applies them without knowing any field. The decision is data:

* ``how``: ``"compare"`` — a difference changes the model's numbers (or its tensors) and is
  refused (under ``--finetune`` a warning); ``"warn"`` — a difference is a warning;
  ``"no"`` — the value may legitimately differ (regularisation, initialisation, precision).
* ``flag``: the flag named in the message.
* ``when``: ``(field, value)``: compared only when both configs have that value there (a RoPE
  setting only when both use RoPE).
* ``note``: said after the line, in parentheses; ``inverted``: a boolean whose flag means False
  (``--disable-bias-linear``); ``values``: words for values in a warning (``"none"`` ->
  ``"exact GELU"``); ``none_is_value``: None is a setting of its own (``--window-size`` unset: full
  attention), compared like any value (otherwise a None in the checkpoint means "not recorded").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConfigCheck", "KINDS", "TRANSFORMER_CONFIG_CHECKS"]

KINDS = ("compare", "warn", "no")


@dataclass(frozen=True)
class ConfigCheck:
    how: str
    flag: str
    when: tuple[str, Any] | None = None
    note: str = ""
    inverted: bool = False
    values: Mapping[str, str] = field(default_factory=dict)
    none_is_value: bool = False

    def __post_init__(self) -> None:
        assert self.how in KINDS, self.how


_ROPE = ("position_embedding_type", "rope")
_LEARNED = ("position_embedding_type", "learned_absolute")  # with RoPE there is no position table
_ROPE_SCALING = ("use_rope_scaling", True)
_MLA = ("multi_latent_attention", True)  # which needs RoPE

# The checks of every TransformerConfig field (a family's table starts from it and adds its own).
TRANSFORMER_CONFIG_CHECKS: dict[str, ConfigCheck] = {
    "num_layers": ConfigCheck("compare", "--num-layers"),
    "hidden_size": ConfigCheck("compare", "--hidden-size"),
    "num_attention_heads": ConfigCheck("compare", "--num-attention-heads"),
    # the padded size; the checkpoint code keeps the checkpoint's when it fits (resume_vocab_size)
    "vocab_size": ConfigCheck("compare", "--vocab-size", note=(
        "the padded vocabulary; it depends on --make-vocab-size-divisible-by x --tensor-model-parallel-size: "
        "choose them so the padding matches")),
    "max_position_embeddings": ConfigCheck("compare", "--max-position-embeddings", when=_LEARNED),
    "ffn_hidden_size": ConfigCheck("compare", "--ffn-hidden-size"),
    "kv_channels": ConfigCheck("compare", "--kv-channels"),
    "num_query_groups": ConfigCheck("compare", "--num-query-groups"),
    "position_embedding_type": ConfigCheck("compare", "--position-embedding-type"),
    "rotary_base": ConfigCheck("compare", "--rotary-base", when=_ROPE),
    "rotary_percent": ConfigCheck("compare", "--rotary-percent", when=_ROPE),
    "rotary_interleaved": ConfigCheck("compare", "--rotary-interleaved", when=_ROPE,
                                      note="which dims RoPE pairs: another layout of the q/k weights"),
    "use_rope_scaling": ConfigCheck("compare", "--use-rope-scaling", when=_ROPE, note="Llama 3.x RoPE scaling"),
    "rope_scaling_factor": ConfigCheck("compare", "--rope-scaling-factor", when=_ROPE_SCALING),
    "rope_scaling_low_freq_factor": ConfigCheck("compare", "--rope-scaling-low-freq-factor", when=_ROPE_SCALING),
    "rope_scaling_high_freq_factor": ConfigCheck("compare", "--rope-scaling-high-freq-factor", when=_ROPE_SCALING),
    "rope_scaling_original_max_position_embeddings": ConfigCheck(
        "compare", "--rope-scaling-original-max-position-embeddings", when=_ROPE_SCALING),
    "normalization": ConfigCheck("compare", "--normalization"),
    "norm_epsilon": ConfigCheck("compare", "--norm-epsilon"),
    "apply_layernorm_1p": ConfigCheck("compare", "--apply-layernorm-1p",
                                      note="the norm weights would mean another scale"),
    "swiglu": ConfigCheck("compare", "--swiglu"),
    # exact or tanh-approximated GELU: a fused-kernel choice in Megatron-LM, hence a warning
    "gelu_approximation": ConfigCheck("warn", "--no-bias-gelu-fusion", when=("swiglu", False), values={
        "none": "exact GELU", "tanh": "tanh-approximated GELU"}, note=(
        "the default with linear biases is the tanh approximation, as Megatron-LM's fused bias-GELU; "
        "--no-bias-gelu-fusion gives exact GELU; --use-checkpoint-args takes the checkpoint's")),
    "add_bias_linear": ConfigCheck("compare", "--disable-bias-linear", inverted=True),
    "add_qkv_bias": ConfigCheck("compare", "--add-qkv-bias"),
    "qk_layernorm": ConfigCheck("compare", "--qk-layernorm"),
    "window_size": ConfigCheck("compare", "--window-size", none_is_value=True),
    "untie_embeddings_and_output_weights": ConfigCheck("compare", "--untie-embeddings-and-output-weights"),
    "fp32_residual_connection": ConfigCheck("no", "--fp32-residual-connection"),  # precision of the residual stream
    "hidden_dropout": ConfigCheck("no", "--hidden-dropout"),
    "attention_dropout": ConfigCheck("no", "--attention-dropout"),
    "init_method_std": ConfigCheck("no", "--init-method-std"),  # initialisation only; the loaded weights replace it
    # mixture of experts: the shape and the routing compare; the balancing losses are regularisation
    "num_moe_experts": ConfigCheck("compare", "--num-experts", none_is_value=True, note="unset: a dense model"),
    "moe_ffn_hidden_size": ConfigCheck("compare", "--moe-ffn-hidden-size"),
    "moe_router_topk": ConfigCheck("compare", "--moe-router-topk"),
    "moe_router_score_function": ConfigCheck("compare", "--moe-router-score-function"),
    "moe_router_pre_softmax": ConfigCheck("compare", "--moe-router-pre-softmax"),
    "moe_router_topk_scaling_factor": ConfigCheck("compare", "--moe-router-topk-scaling-factor", none_is_value=True),
    "moe_router_num_groups": ConfigCheck("compare", "--moe-router-num-groups", none_is_value=True),
    "moe_router_group_topk": ConfigCheck("compare", "--moe-router-group-topk", none_is_value=True),
    "moe_router_dtype": ConfigCheck("no", "--moe-router-dtype"),  # precision of the routing
    "moe_input_jitter_eps": ConfigCheck("no", "--moe-input-jitter-eps"),  # training noise
    "moe_router_load_balancing_type": ConfigCheck("no", "--moe-router-load-balancing-type"),
    "moe_aux_loss_coeff": ConfigCheck("no", "--moe-aux-loss-coeff"),
    "moe_z_loss_coeff": ConfigCheck("no", "--moe-z-loss-coeff"),
    # the expert bias is a buffer of the checkpoint and steers the routing
    "moe_router_enable_expert_bias": ConfigCheck("compare", "--moe-router-enable-expert-bias"),
    "moe_router_bias_update_rate": ConfigCheck("no", "--moe-router-bias-update-rate"),
    "moe_expert_capacity_factor": ConfigCheck("warn", "--moe-expert-capacity-factor", values={
        "None": "no token dropping"}, note="tokens beyond an expert's capacity are dropped"),
    "moe_pad_expert_input_to_capacity": ConfigCheck("no", "--moe-pad-expert-input-to-capacity"),
    "moe_token_drop_policy": ConfigCheck("warn", "--moe-token-drop-policy"),
    "moe_shared_expert_intermediate_size": ConfigCheck("compare", "--moe-shared-expert-intermediate-size",
                                                       none_is_value=True),
    "moe_shared_expert_gate": ConfigCheck("compare", "--moe-shared-expert-gate"),
    "moe_layer_freq": ConfigCheck("compare", "--moe-layer-freq"),
    "moe_grouped_gemm": ConfigCheck("no", "--moe-grouped-gemm"),  # a kernel choice, the same numbers
    "moe_router_force_load_balancing": ConfigCheck("no", "--moe-router-force-load-balancing"),  # a benchmark switch
    # multi-latent attention: every field is the weights' shape or how they are read
    "multi_latent_attention": ConfigCheck("compare", "--multi-latent-attention"),
    "q_lora_rank": ConfigCheck("compare", "--q-lora-rank", when=_MLA, none_is_value=True),
    "kv_lora_rank": ConfigCheck("compare", "--kv-lora-rank", when=_MLA),
    "qk_head_dim": ConfigCheck("compare", "--qk-head-dim", when=_MLA),
    "qk_pos_emb_head_dim": ConfigCheck("compare", "--qk-pos-emb-head-dim", when=_MLA),
    "v_head_dim": ConfigCheck("compare", "--v-head-dim", when=_MLA),
    "rope_type": ConfigCheck("compare", "--rope-type", when=_MLA),
    "rotary_scaling_factor": ConfigCheck("compare", "--rotary-scaling-factor", when=_MLA),
    "mscale": ConfigCheck("compare", "--mscale", when=_MLA),
    "mscale_all_dim": ConfigCheck("compare", "--mscale-all-dim", when=_MLA),
    "yarn_original_max_position_embeddings": ConfigCheck("compare", "--yarn-original-max-position-embeddings",
                                                         when=_MLA),
    "yarn_beta_fast": ConfigCheck("compare", "--yarn-beta-fast", when=_MLA),
    "yarn_beta_slow": ConfigCheck("compare", "--yarn-beta-slow", when=_MLA),
    # multi-token prediction: the depths are tensors of the checkpoint; their loss's weight is a training choice
    "mtp_num_layers": ConfigCheck("compare", "--mtp-num-layers"),
    "mtp_loss_scaling_factor": ConfigCheck("no", "--mtp-loss-scaling-factor"),
    "mtp_use_repeated_layer": ConfigCheck("compare", "--mtp-use-repeated-layer"),  # one set of tensors or D
    "mtp_detach_heads": ConfigCheck("no", "--mtp-detach-heads"),  # which gradients flow, not the model
}
