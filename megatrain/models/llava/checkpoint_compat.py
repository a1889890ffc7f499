"""The LLaVA family's checkpoint checks: how each LlavaConfig field is compared between a checkpoint
and the flags. The two sub-configs are compared whole (any difference in the language model's or the
ViT's flags is named with the sub-config); the frozen parts are a training stage's choice, never a
difference (stage 1 trains the projector, stage 2 loads it and trains the language model too)."""

from __future__ import annotations

from megatrain.models.common.config_checks import ConfigCheck

__all__ = ["CONFIG_CHECKS"]

CONFIG_CHECKS: dict[str, ConfigCheck] = {
    "language": ConfigCheck("compare", "the language model's flags (--num-layers, --hidden-size, ...)"),
    "vision": ConfigCheck("compare", "the vision encoder's flags (--vision-num-layers, --img-h, --patch-dim, ...)"),
    "projector_type": ConfigCheck("compare", "--vision-projection-type"),
    "projector_bias": ConfigCheck("compare", "the projector's bias"),
    "projector_ffn_hidden_size": ConfigCheck("compare", "the projector's width"),
    "vision_feature_layer": ConfigCheck("compare", "--vision-feature-layer"),
    "vision_feature_select_strategy": ConfigCheck("compare", "--disable-vision-class-token"),
    "image_token_id": ConfigCheck("no", "--image-token-index"),
    "pad_token_id": ConfigCheck("no", "the pad token"),
    "freeze_language_model": ConfigCheck("no", "--freeze-LM"),
    "freeze_vision_model": ConfigCheck("no", "--freeze-ViT"),
    "freeze_projector": ConfigCheck("no", "--freeze-vision-projection"),
}
