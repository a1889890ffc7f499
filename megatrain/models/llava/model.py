"""LlavaModel: a vision-language model (LLaVA: a CLIP ViT, a projector, a GPT/LLaMA language model)
as plain single-device PyTorch.

Module paths:

    vision_model.*      the CLIP ViT (:mod:`megatrain.models.llava.vision`)
    projector.*         linear_fc1 (and linear_fc2 for the mlp projector)
    language_model.*    megatrain's GPTModel, unchanged (:mod:`megatrain.models.gpt.model`)

The forward pass, for tokens [b, s] and images [N, channels, img_h, img_w]:

1. the text is laid out with ``tokens_per_image`` positions per image (one placeholder per image is
   expanded, or the text already holds that many: :mod:`megatrain.models.llava.tokens`); positions
   count after the expansion;
2. the encoder runs up to the deepest feature layer; the chosen hidden states (the class token's
   dropped with the "default" strategy) are concatenated and projected: [N, tokens_per_image, h];
3. the language model embeds the text (image positions as the pad token), the image positions'
   embeddings are replaced by the projected features in reading order (as Megatron, the features
   enter as they are: no position embedding or embedding dropout is added to them), and its layers
   and head run on that (``GPTModel.forward(decoder_input=...)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from megatrain.models.common.init import canonical_parameter_name
from megatrain.models.gpt.model import GPTModel
from megatrain.models.gpt.model import initial_value as gpt_initial_value
from megatrain.models.llava.config import LlavaConfig
from megatrain.models.llava.projector import MultimodalProjector, projector_initial_value
from megatrain.models.llava.tokens import ImageTokens, expand_image_tokens
from megatrain.models.llava.vision import VisionEncoder, vision_initial_value

__all__ = ["LlavaModel", "initial_value"]


class LlavaModel(nn.Module):
    """``forward(tokens, images)`` -> logits [b, S, V] over the expanded sequence (S = s when the text
    is already expanded), or with ``labels`` the per-token loss [b, S]. For training, call
    :meth:`expand_tokens` first to get the labels and loss mask of the expanded sequence."""

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.config = config
        device = torch.empty(0).device  # where the model is being built (the default device)
        with torch.device("meta"):  # the parts unfilled (they would each initialise themselves) ...
            self.vision_model = VisionEncoder(config.vision)
            self.projector = MultimodalProjector(config)
            self.language_model = GPTModel(config.language)
        if device.type != "meta":  # ... then every parameter once, by its name in this model
            self.to_empty(device=device)
            self.init_weights(seed=0)
        self.apply_freezing()

    def apply_freezing(self) -> None:
        """The config's frozen parts (``freeze_language_model``, ``freeze_vision_model``,
        ``freeze_projector``) get ``requires_grad=False``: no gradients, so no optimizer state."""
        cfg = self.config
        for part, frozen in ((self.language_model, cfg.freeze_language_model),
                             (self.vision_model, cfg.freeze_vision_model), (self.projector, cfg.freeze_projector)):
            for p in part.parameters():
                p.requires_grad_(not frozen)

    def layer_stacks(self) -> dict[str, nn.ModuleDict]:
        """The two stacks of transformer layers, in forward order (models/common/layer_stacks.py)."""
        return {"vision_model.layers": self.vision_model.layers, "language_model.layers": self.language_model.layers}

    # ---- the language model's head, for the parallel code ------------------------------------------

    @property
    def loss_head(self):
        """The language model's loss head (``GPTModel.loss_head``): the parallel code puts the
        vocab-parallel cross entropy (tensor parallelism) or the chunked one there through this slot."""
        return self.language_model.loss_head

    @loss_head.setter
    def loss_head(self, head) -> None:
        self.language_model.loss_head = head

    def output_weight(self) -> torch.Tensor:
        """The language model's output weight [V, h] (``GPTModel.output_weight``)."""
        return self.language_model.output_weight()

    # ---- the steps of the forward pass ------------------------------------------------------------

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """Images [N, channels, img_h, img_w] -> projected features [N, tokens_per_image, h]."""
        cfg = self.config
        states = self.vision_model.hidden_states(images, cfg.vision_layers_run)
        selected = []
        for index in cfg.feature_layers:
            hidden = states[index]
            if cfg.vision.post_layernorm == "all" and index == cfg.vision.num_layers:
                assert self.vision_model.ln_post is not None  # the encoder's own output
                hidden = self.vision_model.ln_post(hidden)
            if cfg.disable_vision_class_token:
                hidden = hidden[:, cfg.vision.class_token_len:]
            selected.append(hidden)
        return self.projector(torch.cat(selected, dim=-1))

    def expand_tokens(self, tokens: torch.Tensor, num_images: int, *, labels: torch.Tensor | None = None,
                      loss_mask: torch.Tensor | None = None) -> ImageTokens:
        """The text laid out with each image's positions (:func:`expand_image_tokens` with this model's
        placeholder id, tokens per image and pad id)."""
        cfg = self.config
        return expand_image_tokens(tokens, num_images, image_token_id=cfg.image_token_id,
                                   tokens_per_image=cfg.tokens_per_image, pad_token_id=cfg.pad_token_id,
                                   labels=labels, loss_mask=loss_mask)

    def embed(self, layout: ImageTokens, image_features: torch.Tensor | None,
              position_ids: torch.Tensor) -> torch.Tensor:
        """The language model's input [b, S, h]: the text's embeddings, the image positions' replaced
        by ``image_features`` [N, tokens_per_image, h] in reading order."""
        text = layout.tokens.masked_fill(layout.image_mask, self.config.pad_token_id)
        hidden = self.language_model.embed(text, position_ids)
        if image_features is None:
            return hidden
        features = image_features.reshape(-1, image_features.shape[-1]).to(hidden.dtype)
        return hidden.masked_scatter(layout.image_mask.unsqueeze(-1), features)

    def embed_expanded(self, tokens: torch.Tensor, image_mask: torch.Tensor, image_features: torch.Tensor | None,
                       position_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`embed` of text whose image positions are already expanded (``image_mask`` [b, S]);
        what generation calls at the prefill."""
        return self.embed(ImageTokens.laid_out(tokens, image_mask), image_features, position_ids)

    def text_only_term(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` of a batch without images, with the encoder and projector taking part in its graph
        at weight 0 (every trained parameter then has a gradient in every backward)."""
        if any(isinstance(p, DTensor) for p in self.vision_model.parameters()):
            # A text-only batch with the encoder sharded (FSDP2: --use-distributed-optimizer, or data
            # parallel with tensor parallelism): the encoder and projector run on one blank image,
            # with weight 0, so that this rank takes part in their parameters' gathers and gradient
            # reductions as the ranks whose batches have images do.
            cfg = self.config.vision
            blank = torch.zeros(1, cfg.num_channels, cfg.img_h, cfg.img_w, device=hidden.device)
            hidden = hidden + self.image_features(blank).sum().to(hidden.dtype) * 0.0
        elif torch.is_grad_enabled():
            # A text-only batch: the trained encoder/projector parameters take part with weight 0, so
            # that every trained parameter has a gradient in every backward (data parallelism's
            # reduction waits for all of them).
            trained = [p for part in (self.vision_model, self.projector) for p in part.parameters() if p.requires_grad]
            if trained:
                hidden = hidden + sum(p.reshape(-1)[0] for p in trained).to(hidden.dtype) * 0.0
        return hidden

    def forward(self, tokens: torch.Tensor, images: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [b, S, V], or with ``labels`` (aligned with ``tokens``; expanded with them) the
        per-token loss [b, S] in float32.

        ``images``: [N, channels, img_h, img_w], N the images in the text (None: text only).
        ``position_ids`` and ``attention_mask`` (as GPTModel's) are for the expanded sequence; by
        default positions 0 ... S-1 and causal attention (rows padded at the end need no mask).
        ``image_mask`` (bool [b, S]): ``tokens`` and ``labels`` are laid out already (each image's
        positions expanded, :func:`megatrain.models.llava.tokens.expand_image_tokens`), these being
        the image positions; None: they are expanded here.
        """
        if images is not None and images.shape[0] == 0:  # a batch of text-only rows ([0, 3, H, W])
            images = None
        num_images = 0 if images is None else images.shape[0]
        layout = (self.expand_tokens(tokens, num_images, labels=labels) if image_mask is None
                  else ImageTokens.laid_out(tokens, image_mask, labels))
        length = layout.tokens.shape[1]
        if position_ids is None:
            lm = self.config.language
            if lm.position_embedding_type == "learned_absolute" and length > lm.max_position_embeddings:
                raise ValueError(f"sequence of {length} positions (images expanded) is longer than "
                                 f"--max-position-embeddings ({lm.max_position_embeddings})")
            position_ids = torch.arange(length, device=tokens.device).unsqueeze(0)
        elif position_ids.shape[-1] != length:
            raise ValueError(f"position_ids cover {position_ids.shape[-1]} positions, the text with its images "
                             f"expanded has {length}")
        features = self.image_features(images) if images is not None else None
        hidden = self.embed(layout, features, position_ids)
        if features is None:
            hidden = self.text_only_term(hidden)
        return self.language_model(None, position_ids, attention_mask, labels=layout.labels, decoder_input=hidden)

    # ---- parameters -----------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter with ``initial_value`` (also right after meta -> ``to_empty``)."""
        for name, param in self.named_parameters():
            param.copy_(initial_value(name, param.shape, self.config, seed))

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameters of the whole model; ``exclude_embeddings`` leaves out the language model's
        embeddings (and untied output layer), as GPTModel's count."""
        language = self.language_model.num_parameters(exclude_embeddings=exclude_embeddings)
        return language + sum(p.numel() for p in self.vision_model.parameters()) + sum(
            p.numel() for p in self.projector.parameters())


def initial_value(name: str, shape: Sequence[int], config: LlavaConfig, seed: int) -> torch.Tensor:
    """The initial value of parameter ``name``: the language model's by the GPT family's rules (with
    its config), the vision encoder's by :func:`vision_initial_value`, the projector's N(0, std)
    weights and zero biases."""
    name = canonical_parameter_name(name)
    if name.startswith("language_model."):
        return gpt_initial_value(name, shape, config.language, seed)
    if name.startswith("vision_model."):
        return vision_initial_value(name, shape, config.vision, seed)
    if name.startswith("projector."):
        return projector_initial_value(name, shape, config, seed)
    raise ValueError(f"no initialisation rule for parameter {name!r}")
