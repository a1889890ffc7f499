"""Generation from a vision-language (LLaVA) checkpoint: images in, text out.

- **Images** are preprocessed as the checkpoint's run did (its ``--image-processor`` folder, else CLIP's
  defaults at the ViT's ``img_h``): from a file (``tools/generate.py --image``) or from bytes (the server's
  base64 / ``data:`` URLs, :mod:`megatrain.inference.vision_requests`). One that cannot be read is one line
  naming it.
- **Prompts**: each ``<image>`` in a prompt stands for one of its images, in order; a prompt without any
  gets ``"<image>\\n"`` per image in front of its text (LLaVA's layout: the image first). When the tokenizer
  has ``<image>`` as one token it is tokenized in place, else the text around it is tokenized piece by piece
  (LLaVA's ``tokenizer_image_token``); the placeholder becomes the model's ``image_token_id``, expanded to
  ``tokens_per_image`` positions before generation.
- **Prefill, then decoding**: :class:`ImagePrefill` wraps the model for the ordinary generation loop
  (:func:`megatrain.inference.generation.generate`). Its first call (the whole prompt, the KV cache empty)
  runs the vision encoder and projector and gives the language model the text embeddings with the image
  features in place (``decoder_input``); every later call (one token per step, from the KV cache) is the
  language model alone.
- **The server** registers :data:`VISION_GENERATE` on its engine (:func:`register_vision_call`); the
  batching engine runs the language model for text-only requests, image requests go through this call,
  one sequence at a time between the engine's steps.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Callable

import torch
from PIL import Image
from torch import nn

from megatrain.data.multimodal.conversation import IMAGE_PLACEHOLDER, _single_token_id
from megatrain.data.multimodal.image_processing import CLIPImageProcessor, ImageReadError, read_image
from megatrain.inference.generation import generate

__all__ = ["IMAGE_PLACEHOLDER", "VISION_GENERATE", "ImagePrefill", "ImagePrompts", "is_vision_model",
           "text_config", "image_processor_for", "open_image", "generate_with_images", "pack_pixels",
           "unpack_pixels", "vision_generate", "register_vision_call", "complete_with_images"]

VISION_GENERATE = "vision_generate"


def is_vision_model(model: Any) -> bool:
    """Whether ``model`` reads images (a LLaVA model: a vision encoder, a projector, a language model)."""
    return hasattr(model, "image_features") and hasattr(model, "language_model")


def text_config(model: Any) -> Any:
    """The config generation and the engine read: the language model's for a vision model."""
    return model.config.language if is_vision_model(model) else model.config


def image_processor_for(model: Any, saved_args: dict[str, Any] | None = None) -> CLIPImageProcessor:
    """The CLIP preprocessing the checkpoint was trained with: its run's ``--image-processor`` (a folder
    with ``preprocessor_config.json``), else CLIP's defaults at the ViT's ``img_h``; its output must be the
    ViT's input."""
    vision = model.config.vision
    path = (saved_args or {}).get("image_processor")
    if path and not os.path.exists(path):
        raise ValueError(f"the checkpoint's --image-processor {path}: no such file or folder (its run preprocessed "
                         "the images with it)")
    processor = CLIPImageProcessor.from_pretrained(path, size=vision.img_h)
    shape = tuple(processor.output_shape)
    if shape != (vision.num_channels, vision.img_h, vision.img_w):
        raise ValueError(f"the image preprocessing gives {shape[0]} x {shape[1]} x {shape[2]} images but the ViT "
                         f"reads {vision.num_channels} x {vision.img_h} x {vision.img_w}")
    return processor


def open_image(source: str | bytes, name: str) -> Image.Image:
    """The decoded image of a file path or of bytes; a missing or undecodable one raises one line naming
    ``name``."""
    try:
        return read_image(source)
    except ImageReadError as e:
        if e.kind == "missing":
            raise ValueError(f"{name}: no such file") from None
        if e.kind == "directory":
            raise ValueError(f"{name}: is a directory, not an image file") from None
        what = "not a readable image" if e.detail.startswith("UnidentifiedImageError") else e.detail
        raise ValueError(f"{name}: cannot read the image ({what})") from None


def expand_placeholders(ids: Sequence[int], image_token_id: int, tokens_per_image: int) -> list[int]:
    """``ids`` with each image placeholder repeated to its image's ``tokens_per_image`` positions."""
    out: list[int] = []
    for t in ids:
        out.extend([t] * tokens_per_image if t == image_token_id else [t])
    return out


class ImagePrompts:
    """Prompts and images for one vision model and tokenizer (the module docstring's rules)."""

    def __init__(self, model: Any, tokenizer: Any, processor: CLIPImageProcessor) -> None:
        cfg = model.config
        self.tokenizer, self.processor = tokenizer, processor
        self.image_token_id, self.tokens_per_image = int(cfg.image_token_id), int(cfg.tokens_per_image)
        self.placeholder_id = _single_token_id(tokenizer, IMAGE_PLACEHOLDER)

    def with_placeholders(self, text: str, num_images: int, where: str = "the prompt") -> str:
        """``text`` with ``<image>\\n`` per image in front when it has no placeholder; else its placeholder
        count must be the image count."""
        count = text.count(IMAGE_PLACEHOLDER)
        if count == 0 and num_images:
            return f"{IMAGE_PLACEHOLDER}\n" * num_images + text
        if count != num_images:
            raise ValueError(f"{where} has {count} {IMAGE_PLACEHOLDER} placeholders for {num_images} images: give "
                             f"one per image, or none to put the images before the text")
        return text

    def tokenize(self, text: str, encode: Callable[[str], Sequence[int]] | None = None) -> list[int]:
        """Token ids of ``text``, each ``<image>`` the model's ``image_token_id``."""
        encode = encode or self.tokenizer.tokenize
        if self.placeholder_id is not None:
            return [self.image_token_id if t == self.placeholder_id else int(t) for t in encode(text)]
        bos = getattr(self.tokenizer, "bos", None)
        out: list[int] = []
        for k, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
            if k:
                out.append(self.image_token_id)
            ids = [int(t) for t in encode(piece)] if piece else []
            if k and bos is not None and ids and ids[0] == bos:
                ids = ids[1:]  # BOS only at the very start
            out.extend(ids)
        return out

    def count(self, ids: Sequence[int]) -> int:
        return sum(1 for t in ids if t == self.image_token_id)

    def expanded_length(self, ids: Sequence[int]) -> int:
        """The positions ``ids`` take once each image is expanded."""
        return len(ids) + self.count(ids) * (self.tokens_per_image - 1)

    def render(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, each image placeholder written ``<image>``."""
        pieces, current = [], []
        for t in ids:
            if t == self.image_token_id:
                pieces.append(current)
                current = []
            else:
                current.append(int(t))
        pieces.append(current)
        return IMAGE_PLACEHOLDER.join(self.tokenizer.detokenize(p) if p else "" for p in pieces)

    def pixels(self, image: Image.Image) -> torch.Tensor:
        """The preprocessed image [channels, img_h, img_w] (float32)."""
        return self.processor(image)


class ImagePrefill(nn.Module):
    """``model`` (a LLaVA model) as the generation loop calls it: ``forward(tokens, position_ids,
    attention_mask, kv_cache)``. The first call (prefill, the cache empty) puts the features of ``images``
    [N, channels, H, W] at the image positions of ``prompt_ids`` (expanded, as the loop left-pads them, in
    reading order); later calls run the language model alone on the new tokens."""

    def __init__(self, model: nn.Module, prompt_ids: Sequence[Sequence[int]], images: torch.Tensor | None) -> None:
        super().__init__()
        self.model = model
        self.config = model.config.language  # what generate() checks positions against
        self.prompt_ids = [list(p) for p in prompt_ids]
        self.images = images if images is not None and images.shape[0] > 0 else None

    def _image_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        mask = torch.zeros(b, s, dtype=torch.bool)
        image_id = self.model.config.image_token_id
        for i, p in enumerate(self.prompt_ids):  # left-padded: row i's prompt ends at column s
            mask[i, s - len(p):] = torch.tensor([t == image_id for t in p], dtype=torch.bool)
        return mask.to(tokens.device)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, kv_cache: Any = None) -> torch.Tensor:
        lm = self.model.language_model
        if self.images is None or (kv_cache is not None and kv_cache.length > 0):
            return lm(tokens, position_ids, attention_mask, kv_cache=kv_cache)
        mask = self._image_mask(tokens)
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        vision_param = next(self.model.vision_model.parameters())
        features = self.model.image_features(self.images.to(vision_param.device, vision_param.dtype))
        if int(mask.sum()) != features.shape[0] * features.shape[1]:
            raise ValueError(f"the prompts hold {int(mask.sum())} image positions for {features.shape[0]} images "
                             f"of {features.shape[1]} positions")
        hidden = self.model.embed_expanded(tokens, mask, features, position_ids)
        return lm(None, position_ids, attention_mask, kv_cache=kv_cache, decoder_input=hidden)


def generate_with_images(model: nn.Module, prompt_ids: Sequence[Sequence[int]],
                         images: Sequence[Sequence[torch.Tensor]], max_new_tokens: int, **sampling: Any) -> list[list[int]]:
    """:func:`generate` for a LLaVA model: ``prompt_ids[i]`` holds one ``image_token_id`` per image of
    ``images[i]`` (preprocessed [channels, H, W] tensors); returns the new tokens of each prompt."""
    cfg = model.config
    for i, (ids, imgs) in enumerate(zip(prompt_ids, images, strict=True)):
        count = sum(1 for t in ids if t == cfg.image_token_id)
        if count != len(imgs):
            raise ValueError(f"prompt {i} holds {count} image placeholders (id {cfg.image_token_id}) for "
                             f"{len(imgs)} images")
    expanded = [expand_placeholders(p, cfg.image_token_id, cfg.tokens_per_image) for p in prompt_ids]
    flat = [img for imgs in images for img in imgs]
    pixels = torch.stack(list(flat)) if flat else None
    return generate(ImagePrefill(model, expanded, pixels), expanded, max_new_tokens, **sampling)


def new_token_logprobs(model: nn.Module, ids: Sequence[int], images: Sequence[torch.Tensor], new: Sequence[int],
                       top_n: int = 0, vocab_size: int | None = None) -> tuple[list[float], list[list[list[float]]]]:
    """The model's log-probability of each of ``new`` after the prompt ``ids`` with ``images`` (one full
    forward), and with ``top_n`` the ``top_n`` most likely ``[id, logprob]`` at each of those positions."""
    if not new:
        return [], []
    cfg = model.config
    device = next(model.parameters()).device
    tokens = torch.tensor([list(ids) + list(new[:-1])], dtype=torch.long, device=device)
    pixels = torch.stack(list(images)).to(device, next(model.vision_model.parameters()).dtype) if images else None
    start = len(expand_placeholders(ids, cfg.image_token_id, cfg.tokens_per_image)) - 1
    with torch.inference_mode():
        logp = model(tokens, pixels)[0, start:start + len(new)].float().log_softmax(-1)
        picked = logp.gather(-1, torch.tensor(list(new), device=device)[:, None])[:, 0].tolist()
        top: list[list[list[float]]] = []
        if top_n:
            values, top_ids = logp[:, :vocab_size].topk(top_n, dim=-1)
            top = [[[i, v] for i, v in zip(ri, rv)] for ri, rv in zip(top_ids.tolist(), values.tolist())]
    return picked, top


def pack_pixels(pixels: torch.Tensor) -> dict[str, Any]:
    """A preprocessed image as plain JSON (an engine call's payload): its shape and float32 bytes, base64."""
    data = pixels.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()
    return {"shape": list(pixels.shape), "data": base64.b64encode(data).decode("ascii")}


def unpack_pixels(packed: dict[str, Any]) -> torch.Tensor:
    raw = bytearray(base64.b64decode(packed["data"]))
    return torch.frombuffer(raw, dtype=torch.float32).reshape(packed["shape"])


def vision_generate(model: nn.Module, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The server's image generation (an engine call): for each of ``payload["prompts"]`` (token ids with
    image placeholders) and ``payload["images"]`` (its packed images), alone, with its seed of
    ``payload["seeds"]``: the new ``tokens``, and with ``logprobs`` their ``logprobs`` (and ``top``)."""
    out = []
    top_n = int(payload.get("top_n") or 0)
    for ids, packed, seed in zip(payload["prompts"], payload["images"], payload["seeds"], strict=True):
        imgs = [unpack_pixels(p) for p in packed]
        new = generate_with_images(model, [ids], [imgs], int(payload["max_new_tokens"]),
                                   greedy=bool(payload["greedy"]), temperature=float(payload["temperature"]),
                                   top_k=int(payload["top_k"]), top_p=float(payload["top_p"]), eod=payload.get("eod"),
                                   stop_token_sequences=payload.get("stop_token_sequences") or None,
                                   seed=seed)[0]
        result: dict[str, Any] = {"tokens": new}
        if payload.get("logprobs"):
            result["logprobs"], result["top"] = new_token_logprobs(model, ids, imgs, new, top_n,
                                                                   payload.get("vocab_size"))
        out.append(result)
    return out


def register_vision_call(engine: Any, model: nn.Module) -> None:
    """Register :data:`VISION_GENERATE` on ``engine`` (which may run ``model.language_model``): the call
    runs on the whole vision-language ``model``."""
    engine.register(VISION_GENERATE, lambda _engine_model, payload: vision_generate(model, payload))


def complete_with_images(model: nn.Module, tokenizer: Any, prompts: list[str], images: list[Image.Image],
                         params: Any, micro_batch_size: int | None = None, processor: Any = None) -> list[Any]:
    """``tools/generate.py`` on a LLaVA model: every prompt with ``images`` (none: text only), completed as
    :func:`megatrain.inference.text_generation.complete` does (stop strings, end tokens); the vision part
    runs at each micro-batch's prefill."""
    from megatrain.inference.text_generation import complete

    helper = ImagePrompts(model, tokenizer, processor or image_processor_for(model))
    pixels = [helper.pixels(im) for im in images]
    texts = [helper.with_placeholders(p, len(images), f"--prompt {p!r}") for p in prompts]
    ids = [helper.tokenize(t) for t in texts]
    cfg = model.config
    size = micro_batch_size or len(prompts) or 1
    out: list[Any] = []
    for start in range(0, len(prompts), size):
        chunk = ids[start:start + size]
        expanded = [expand_placeholders(p, cfg.image_token_id, cfg.tokens_per_image) for p in chunk]
        stacked = torch.stack(pixels * len(chunk)) if pixels else None
        chunk_params = params if params.seed is None else replace(params, seed=params.seed + start)
        out += complete(ImagePrefill(model, expanded, stacked), tokenizer, texts[start:start + size], chunk_params,
                        prompt_ids=expanded)
    return out
