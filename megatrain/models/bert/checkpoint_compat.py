"""The BERT family's checkpoint checks: the transformer fields' shared table plus BERT's heads."""

from __future__ import annotations

from megatrain.models.common.config_checks import TRANSFORMER_CONFIG_CHECKS, ConfigCheck

__all__ = ["CONFIG_CHECKS"]

CONFIG_CHECKS: dict[str, ConfigCheck] = {
    **TRANSFORMER_CONFIG_CHECKS,
    "add_binary_head": ConfigCheck("compare", "--bert-no-binary-head", inverted=True),
    "num_tokentypes": ConfigCheck("compare", "--bert-no-binary-head", note="two token types with the binary head"),
}
