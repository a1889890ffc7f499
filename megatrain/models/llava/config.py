"""Typed configuration of the LLaVA family: :class:`VisionConfig` (the CLIP-style ViT encoder) and
:class:`LlavaConfig` (the whole model: a GPT/LLaMA-family language model, the vision encoder, the
projector between them, and how images enter the text).

Field names follow Megatron-LM's multimodal flags where there is one:

==========================================  =============================================================
flag                                        field
==========================================  =============================================================
``--vision-model-type clip``                ``VisionConfig.vision_model_type``
``--patch-dim``, ``--img-h``, ``--img-w``   ``VisionConfig.patch_dim``, ``img_h``, ``img_w``
``--num-channels``                          ``VisionConfig.num_channels``
vision num layers / hidden / heads / ffn    ``VisionConfig.num_layers``, ``hidden_size``,
                                            ``num_attention_heads``, ``ffn_hidden_size`` (the shared
                                            transformer shape, :class:`TransformerConfig`)
``--disable-vision-class-token``            ``LlavaConfig.vision_feature_select_strategy = "default"``
                                            (the class token's feature is dropped; "full" keeps it)
``--image-token-index`` (Megatron: -200)    ``LlavaConfig.image_token_id``
==========================================  =============================================================

``vision_feature_layer`` and ``vision_feature_select_strategy`` are LLaVA's (Hugging Face's
``LlavaConfig``): features come from the hidden states after a chosen number of encoder layers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Union

from megatrain.models.common.config import TransformerConfig
from megatrain.models.gpt.config import GPTConfig

__all__ = ["VisionConfig", "LlavaConfig", "VISION_ACTIVATIONS", "POST_LAYERNORM", "PROJECTOR_TYPES",
           "FEATURE_SELECT_STRATEGIES", "MEGATRON_IMAGE_TOKEN_ID"]

VISION_MODEL_TYPES = ("clip",)
VISION_ACTIVATIONS = ("quick_gelu", "gelu")  # quick_gelu: x * sigmoid(1.702 x), OpenAI CLIP's
# Where the final LayerNorm ``ln_post`` applies: nowhere (no ln_post: Megatron's CLIP), on the class
# token's output only (Hugging Face's CLIPVisionModel ``post_layernorm``: its pooler output), or on
# every output token (Megatron's ln_post).
POST_LAYERNORM = ("none", "pooled", "all")
PROJECTOR_TYPES = ("mlp", "affine")  # Linear-GELU-Linear (LLaVA 1.5), or one Linear (LLaVA 1.0)
FEATURE_SELECT_STRATEGIES = ("default", "full")  # default: drop the class token's feature
MEGATRON_IMAGE_TOKEN_ID = -200  # Megatron's (and the original LLaVA code's) placeholder id


@dataclass
class VisionConfig(TransformerConfig):
    """A CLIP ViT: a strided convolution (no bias) cuts the image into ``patch_dim`` x ``patch_dim``
    patches, a learned class token goes first, learned positions are added, ``ln_pre`` normalises,
    then pre-LN bidirectional transformer layers (LayerNorm, biases, an fc1-activation-fc2 MLP).

    ``max_position_embeddings`` is derived (one position per patch, plus the class token); 0 means
    "derive it". ``vocab_size`` is unused (the encoder has no token embedding).
    """

    max_position_embeddings: int = 0
    hidden_dropout: float = 0.0  # CLIP has no dropout
    attention_dropout: float = 0.0
    vision_model_type: str = "clip"
    patch_dim: int = 14
    img_h: int = 336
    img_w: int = 336
    num_channels: int = 3
    add_class_token: bool = True
    activation: str = "quick_gelu"  # or "gelu" (exact, or tanh with gelu_approximation="tanh")
    post_layernorm: str = "none"  # see POST_LAYERNORM

    causal_attention: ClassVar[bool] = False
    position_embedding_types: ClassVar[tuple[str, ...]] = ("learned_absolute",)
    supports_moe: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.vision_model_type not in VISION_MODEL_TYPES:
            raise ValueError(f"--vision-model-type must be {' or '.join(VISION_MODEL_TYPES)}, "
                             f"got {self.vision_model_type!r}")
        for name in ("patch_dim", "img_h", "img_w", "num_channels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name in ("img_h", "img_w"):
            if getattr(self, name) % self.patch_dim:
                raise ValueError(f"--{name.replace('_', '-')} ({getattr(self, name)}) must be a multiple of "
                                 f"--patch-dim ({self.patch_dim})")
        if self.activation not in VISION_ACTIVATIONS:
            raise ValueError(f"vision activation must be {' or '.join(VISION_ACTIVATIONS)}, got {self.activation!r}")
        if self.post_layernorm not in POST_LAYERNORM:
            raise ValueError(f"vision post_layernorm must be one of {', '.join(POST_LAYERNORM)}, "
                             f"got {self.post_layernorm!r}")
        if self.post_layernorm == "pooled" and not self.add_class_token:
            raise ValueError("vision post_layernorm 'pooled' normalises the class token's output: it needs the "
                             "class token (add_class_token)")
        if self.swiglu:
            raise ValueError("--swiglu: a CLIP ViT's MLP is fc1, activation, fc2 (quick_gelu or gelu)")
        if self.normalization != "LayerNorm":
            raise ValueError(f"--normalization: a CLIP ViT uses LayerNorm, got {self.normalization!r}")
        if self.max_position_embeddings == 0:
            self.max_position_embeddings = self.seq_length
        elif self.max_position_embeddings != self.seq_length:
            raise ValueError(f"vision max_position_embeddings ({self.max_position_embeddings}) must be the number of "
                             f"patches plus the class token ({self.seq_length}); leave it 0 to derive it")
        super().__post_init__()

    @property
    def num_patches(self) -> int:
        return (self.img_h // self.patch_dim) * (self.img_w // self.patch_dim)

    @property
    def class_token_len(self) -> int:
        return 1 if self.add_class_token else 0

    @property
    def seq_length(self) -> int:
        """Tokens the encoder runs on per image: the patches, after the class token."""
        return self.num_patches + self.class_token_len


def _as_config(value: Any, cls: type) -> Any:
    """A sub-config given as a dict (read back from JSON) as its dataclass."""
    if isinstance(value, dict):
        return cls(**value)
    if not isinstance(value, cls):
        raise ValueError(f"expected a {cls.__name__} or a dict of its fields, got {type(value).__name__}")
    return value


@dataclass
class LlavaConfig:
    """A LLaVA model: ``vision`` encodes each image, the projector maps the chosen encoder features
    to the language model's width, and ``language`` (any GPT-family config: GPT-2 or LLaMA style)
    reads the text with each image's placeholder token stood in for by ``tokens_per_image``
    projected features.

    ``vision_feature_layer``: which hidden states feed the projector, indexed as Hugging Face's
    ``hidden_states`` (0: the embeddings after ``ln_pre``, k: after k layers; negative counts from
    the end, -1 is the last layer's output); a list concatenates several along the hidden dim.
    ``projector_ffn_hidden_size``: the MLP projector's inner width (None: the language model's
    hidden size, as Hugging Face's ``LlavaMultiModalProjector``).
    """

    language: GPTConfig = field(default_factory=GPTConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    projector_type: str = "mlp"
    projector_bias: bool = True
    projector_ffn_hidden_size: int | None = None
    image_token_id: int = MEGATRON_IMAGE_TOKEN_ID
    pad_token_id: int = 0  # what expanded rows are padded with (and what image positions embed as)
    vision_feature_layer: Union[int, list[int]] = -2
    vision_feature_select_strategy: str = "default"
    # Megatron's --freeze-LM, --freeze-ViT, --freeze-vision-projection: the part's parameters are
    # built with requires_grad=False (no gradients, no optimizer state). Training stages, not shapes.
    freeze_language_model: bool = False
    freeze_vision_model: bool = False
    freeze_projector: bool = False

    def __post_init__(self) -> None:
        self.language = _as_config(self.language, GPTConfig)
        self.vision = _as_config(self.vision, VisionConfig)
        if self.language.mtp_num_layers:
            raise ValueError("--mtp-num-layers: multi-token prediction is built for the GPT family's decoder only, "
                             "not for a vision-language model's")
        if self.projector_type not in PROJECTOR_TYPES:
            raise ValueError(f"projector type must be {' or '.join(PROJECTOR_TYPES)}, got {self.projector_type!r}")
        if self.projector_ffn_hidden_size is None:
            self.projector_ffn_hidden_size = self.language.hidden_size
        if self.projector_ffn_hidden_size <= 0:
            raise ValueError(f"projector_ffn_hidden_size must be positive, got {self.projector_ffn_hidden_size}")
        if self.vision_feature_select_strategy not in FEATURE_SELECT_STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy must be {' or '.join(FEATURE_SELECT_STRATEGIES)}, "
                             f"got {self.vision_feature_select_strategy!r}")
        if self.vision_feature_select_strategy == "default" and not self.vision.add_class_token:
            raise ValueError("vision_feature_select_strategy 'default' drops the class token's feature: the vision "
                             "encoder has none (use 'full')")
        for name in ("image_token_id", "pad_token_id"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if not 0 <= self.pad_token_id < self.language.vocab_size:
            raise ValueError(f"pad_token_id must be a token id below the vocabulary size "
                             f"({self.language.vocab_size}), got {self.pad_token_id}")
        if self.image_token_id == self.pad_token_id:
            raise ValueError(f"image_token_id and pad_token_id must differ, both are {self.image_token_id}")
        layers = self.vision_feature_layer
        if isinstance(layers, tuple):
            layers = self.vision_feature_layer = list(layers)
        choices = layers if isinstance(layers, list) else [layers]
        if not choices or any(isinstance(i, bool) or not isinstance(i, int) for i in choices):
            raise ValueError(f"vision_feature_layer must be an integer or a non-empty list of them, got {layers!r}")
        n = self.vision.num_layers
        for i in choices:
            if not -(n + 1) <= i <= n:
                raise ValueError(f"vision_feature_layer {i} is out of range for a {n}-layer vision encoder "
                                 f"(hidden states {-(n + 1)} ... {n})")

    # ---- derived shapes ---------------------------------------------------------------------------

    @property
    def feature_layers(self) -> list[int]:
        """``vision_feature_layer`` as non-negative hidden-state indices (k: after k layers)."""
        layers = self.vision_feature_layer
        layers = layers if isinstance(layers, list) else [layers]
        n = self.vision.num_layers
        return [i if i >= 0 else n + 1 + i for i in layers]

    @property
    def vision_layers_run(self) -> int:
        """Encoder layers the model runs: those up to the deepest chosen feature layer."""
        return max(self.feature_layers)

    @property
    def disable_vision_class_token(self) -> bool:
        """Megatron's ``--disable-vision-class-token``: the class token's feature does not reach the text."""
        return self.vision_feature_select_strategy == "default"

    @property
    def tokens_per_image(self) -> int:
        """Positions one image takes in the language model's sequence."""
        return self.vision.num_patches + (0 if self.disable_vision_class_token else self.vision.class_token_len)

    @property
    def projector_input_size(self) -> int:
        return self.vision.hidden_size * len(self.feature_layers)

    # The language model's shape, which the parallel layout's checks read (tensor parallelism shards
    # the language model only; the vision encoder and projector are replicated).
    @property
    def num_attention_heads(self) -> int:
        return self.language.num_attention_heads

    @property
    def num_query_groups(self) -> int | None:
        return self.language.num_query_groups

    @property
    def ffn_hidden_size(self) -> int | None:
        return self.language.ffn_hidden_size

    @property
    def vocab_size(self) -> int:
        return self.language.vocab_size

    @property
    def causal_attention(self) -> bool:
        return True

    def to_dict(self) -> dict[str, Any]:
        """Plain fields (the sub-configs as dicts); ``LlavaConfig(**d)`` rebuilds it."""
        return asdict(self)


# The language model's shape fields, read through the LLaVA config by the Hugging Face conversion (its
# log lines, the tokenizer's model_max_length, the pretrain_vlm.py flags an import prints).
for _name in ("num_layers", "hidden_size", "max_position_embeddings", "norm_epsilon", "init_method_std",
              "kv_channels", "position_embedding_type", "rotary_base", "normalization", "swiglu", "add_bias_linear",
              "add_qkv_bias", "gelu_approximation", "qk_layernorm", "untie_embeddings_and_output_weights",
              "hidden_dropout", "attention_dropout", "head_dim", "heads_per_group",
              # multi-latent attention (megatrain.convert.import_hf.mla_flags reads them)
              "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
              "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow"):
    setattr(LlavaConfig, _name, property(lambda self, _n=_name: getattr(self.language, _n),
                                         doc=f"The language model's ``{_name}``."))
del _name
