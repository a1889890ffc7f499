"""The T5 family's checkpoint checks: the transformer fields' shared table plus T5's own."""

from __future__ import annotations

from megatrain.models.common.config_checks import TRANSFORMER_CONFIG_CHECKS, ConfigCheck

__all__ = ["CONFIG_CHECKS"]

_RELATIVE = ("position_embedding_type", "relative")

CONFIG_CHECKS: dict[str, ConfigCheck] = {
    **TRANSFORMER_CONFIG_CHECKS,
    "num_layers": ConfigCheck("compare", "--encoder-num-layers"),
    "decoder_num_layers": ConfigCheck("compare", "--decoder-num-layers"),
    "relative_attention_num_buckets": ConfigCheck("compare", "--relative-attention-num-buckets", when=_RELATIVE),
    "relative_attention_max_distance": ConfigCheck("compare", "--relative-attention-max-distance", when=_RELATIVE),
    # the data's shape, not the weights' (it only enters the FLOPs of the log line)
    "decoder_seq_length": ConfigCheck("no", "--decoder-seq-length"),
    # the attention kernel (FlexAttention or SDPA): the same numbers either way
    "attention_backend": ConfigCheck("no", "--attention-backend"),
    # how SDPA's relative bias gets its gradient (MEGATRAIN_T5_BIAS_GRADIENT, beside the kernel choice
    # of --attention-backend): the same numbers either way
    "bias_gradient": ConfigCheck("no", "--attention-backend"),
}
