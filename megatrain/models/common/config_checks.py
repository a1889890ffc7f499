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
}
