"""CLIP image preprocessing in plain torch + PIL, equal to transformers' PIL-based
``CLIPImageProcessor`` (``CLIPImageProcessorPil`` in transformers 5, ``use_fast=False`` before).

The steps, in transformers' order and arithmetic:

1. convert to RGB: an image with transparency (an ``A`` band, or a ``transparency`` entry, e.g. a
   palette image) is composited onto white (PIL ``alpha_composite`` over an opaque white RGBA image),
   any other mode is ``convert("RGB")``;
2. resize (PIL, ``resample``: bicubic for CLIP) so that the shortest side is ``shortest_edge`` and the
   longest ``int(shortest_edge * long / short)`` (or to an exact ``height`` x ``width``);
3. center crop to ``crop_size``: offsets ``(H - h) // 2``, ``(W - w) // 2``; an image smaller than the
   crop is first zero-padded around (``ceil`` of half the missing rows/columns before it);
4. rescale: ``float64(pixel) * rescale_factor`` (1/255), then float32;
5. normalize: ``(x - mean) / std`` in float32, per channel.

The result is a float32 tensor ``[3, crop_height, crop_width]`` (channels first). The configuration
comes from a model folder's ``preprocessor_config.json`` (:meth:`CLIPImageConfig.from_pretrained`)
or from :meth:`CLIPImageConfig.default` (224 or 336 px, OpenAI CLIP's mean and std).
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from PIL import Image

__all__ = ["CLIPImageConfig", "CLIPImageProcessor", "OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD", "convert_to_rgb",
           "ImageReadError", "read_image"]


class ImageReadError(ValueError):
    """An image that cannot be read: ``kind`` is "missing", "directory" or "unreadable" (``detail``: what
    the decoder said); each caller words it for its input (a data file's line, a request's field)."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind, self.detail = kind, detail


def read_image(source: str | bytes) -> Image.Image:
    """The decoded image (decoded now, not lazily) of a file path or of encoded bytes, else ImageReadError."""
    try:
        image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
        image.load()
    except FileNotFoundError:
        raise ImageReadError("missing") from None
    except IsADirectoryError:
        raise ImageReadError("directory") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageReadError("unreadable", f"{type(e).__name__}: {e}") from None
    return image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

#: transformers' ``PILImageResampling`` values are PIL's (``resample`` in preprocessor_config.json).
_RESAMPLE = {int(r): r for r in Image.Resampling}


def _pair(value: Any, what: str, where: str) -> tuple[int, int] | None:
    """(height, width) of a ``crop_size``/``size`` given as an int or ``{"height", "width"}``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{where}: {what} must be an int or {{\"height\", \"width\"}}, got {value!r}")
    if isinstance(value, int):
        return value, value
    if isinstance(value, Mapping) and isinstance(value.get("height"), int) and isinstance(value.get("width"), int):
        return int(value["height"]), int(value["width"])
    raise ValueError(f"{where}: {what} must be an int or {{\"height\", \"width\"}}, got {value!r}")


@dataclass(frozen=True)
class CLIPImageConfig:
    """The fields of a CLIP ``preprocessor_config.json`` this processor reads. ``shortest_edge`` resizes
    keeping the aspect ratio; ``resize_to`` (height, width) resizes to an exact size instead."""

    shortest_edge: int | None = 224
    resize_to: tuple[int, int] | None = None
    crop_size: tuple[int, int] = (224, 224)
    resample: int = int(Image.Resampling.BICUBIC)
    do_convert_rgb: bool = True
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    @classmethod
    def default(cls, size: int = 224) -> "CLIPImageConfig":
        """OpenAI CLIP's preprocessing at ``size`` px (224: ViT-L/14, 336: ViT-L/14-336 as LLaVA-1.5)."""
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"image size must be a positive int (224 or 336 for CLIP), got {size!r}")
        return cls(shortest_edge=size, crop_size=(size, size))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "preprocessor config") -> "CLIPImageConfig":
        """From the dict of a ``preprocessor_config.json`` (transformers' key names; missing keys take
        CLIP's defaults, as ``CLIPImageProcessor`` does)."""
        # transformers writes unset values as null (and a SizeDict's unused keys): those take the defaults
        d = {k: v for k, v in d.items() if v is not None}
        out = cls()
        size = d.get("size", {"shortest_edge": 224})
        size = {k: v for k, v in size.items() if v is not None} if isinstance(size, Mapping) else size
        if isinstance(size, int) and not isinstance(size, bool):
            out = replace(out, shortest_edge=size, resize_to=None)  # default_to_square=False: the shortest edge
        elif isinstance(size, Mapping) and set(size) == {"shortest_edge"} and isinstance(size["shortest_edge"], int):
            out = replace(out, shortest_edge=int(size["shortest_edge"]), resize_to=None)
        elif isinstance(size, Mapping) and set(size) == {"height", "width"}:
            out = replace(out, shortest_edge=None, resize_to=_pair(size, "size", where))
        else:
            raise ValueError(f"{where}: size {size!r} is not supported (an int, {{\"shortest_edge\": N}} or "
                             "{\"height\": H, \"width\": W})")
        crop = d.get("crop_size", {"height": 224, "width": 224})
        crop = {k: v for k, v in crop.items() if v is not None} if isinstance(crop, Mapping) else crop
        crop = _pair(crop, "crop_size", where)
        resample = d.get("resample", int(Image.Resampling.BICUBIC))
        if resample not in _RESAMPLE:
            raise ValueError(f"{where}: resample {resample!r} is not a PIL resampling filter "
                             f"({', '.join(f'{int(r)}={r.name}' for r in Image.Resampling)})")
        mean = tuple(float(x) for x in d.get("image_mean", OPENAI_CLIP_MEAN))
        std = tuple(float(x) for x in d.get("image_std", OPENAI_CLIP_STD))
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"{where}: image_mean and image_std need 3 values (RGB), got {mean} and {std}")
        flags = {k: bool(d.get(k, True)) for k in ("do_convert_rgb", "do_resize", "do_center_crop", "do_rescale",
                                                   "do_normalize")}
        return replace(out, crop_size=crop, resample=int(resample), image_mean=mean, image_std=std,
                       rescale_factor=float(d.get("rescale_factor", 1 / 255)), **flags)

    @classmethod
    def from_pretrained(cls, path: str, flag: str = "--image-processor") -> "CLIPImageConfig":
        """From ``path``: a ``preprocessor_config.json`` or a (Hugging Face model) folder holding one."""
        file = os.path.join(path, "preprocessor_config.json") if os.path.isdir(path) else path
        where = f"{flag} {file}"
        try:
            with open(file, encoding="utf-8") as f:
                d = json.load(f)
        except OSError as e:
            raise ValueError(f"{where}: cannot read ({e.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object")
        return cls.from_dict(d, where)

    @property
    def output_shape(self) -> tuple[int, int, int]:
        """(3, height, width) of a processed image (with center crop; else the resize's exact size)."""
        if self.do_center_crop:
            return (3, *self.crop_size)
        if self.do_resize and self.resize_to is not None:
            return (3, *self.resize_to)
        raise ValueError("without center crop, images keep their own aspect ratio: no fixed output shape")


def convert_to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (transformers' ``convert_to_rgb``)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _resize_shape(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """(height, width) with the shortest side ``shortest_edge`` (transformers' ``default_to_square=False``)."""
    if width <= height:
        return int(shortest_edge * height / width), shortest_edge
    return shortest_edge, int(shortest_edge * width / height)


def _center_crop(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[C, H, W] -> [C, height, width] around the center, zero-padded where the image is smaller."""
    h, w = x.shape[-2:]
    if h < height or w < width:
        new_h, new_w = max(height, h), max(width, w)
        top_pad, left_pad = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
        padded = x.new_zeros((x.shape[0], new_h, new_w))
        padded[:, top_pad:top_pad + h, left_pad:left_pad + w] = x
        top, left = (h - height) // 2 + top_pad, (w - width) // 2 + left_pad
        top0, left0 = max(0, top), max(0, left)
        return padded[:, top0:min(new_h, top + height), left0:min(new_w, left + width)]
    top, left = (h - height) // 2, (w - width) // 2
    return x[:, top:top + height, left:left + width]


class CLIPImageProcessor:
    """PIL image(s) -> float32 ``[3, H, W]`` (or ``[n, 3, H, W]`` for a list), as transformers' PIL
    ``CLIPImageProcessor`` with the same configuration."""

    def __init__(self, config: CLIPImageConfig | None = None):
        self.config = config or CLIPImageConfig.default()
        c = self.config
        self._mean = torch.tensor(c.image_mean, dtype=torch.float32).view(3, 1)
        self._std = torch.tensor(c.image_std, dtype=torch.float32).view(3, 1)
        self._tables: dict[int, torch.Tensor] = {}

    @classmethod
    def from_pretrained(cls, path: str | None = None, size: int = 224) -> "CLIPImageProcessor":
        """From a model folder's ``preprocessor_config.json`` when ``path`` is given, else CLIP's defaults
        at ``size`` px."""
        return cls(CLIPImageConfig.from_pretrained(path) if path else CLIPImageConfig.default(size))

    @property
    def output_shape(self) -> tuple[int, int, int]:
        return self.config.output_shape

    def __call__(self, image: Image.Image | Sequence[Image.Image]) -> torch.Tensor:
        if isinstance(image, Image.Image):
            return self.preprocess(image)
        return torch.stack([self.preprocess(i) for i in image])

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        c = self.config
        if c.do_convert_rgb:
            image = convert_to_rgb(image)
        elif image.mode not in ("RGB", "L"):
            raise ValueError(f"image mode {image.mode} needs do_convert_rgb")
        if c.do_resize:
            if c.resize_to is not None:
                height, width = c.resize_to
            else:
                height, width = _resize_shape(image.height, image.width, c.shortest_edge)
            image = image.resize((width, height), resample=_RESAMPLE[c.resample])
        x = torch.from_numpy(np.array(image, copy=True))  # uint8 [H, W, C]
        if x.dtype != torch.uint8:
            raise ValueError(f"image mode {image.mode} is not 8-bit; convert it to RGB (do_convert_rgb)")
        x = x.unsqueeze(-1) if x.dim() == 2 else x
        x = x.permute(2, 0, 1)
        if c.do_center_crop:
            x = _center_crop(x, *c.crop_size)
        channels, height, width = x.shape
        if c.do_normalize and channels != 3:
            raise ValueError(f"normalizing needs 3 channels, the image has {channels}")
        # Every pixel is one of 256 values per channel: look its result up in a table made by the same
        # float operations (so the same bits), one pass over the image instead of four.
        table = self._table(channels)
        return table.gather(1, x.reshape(channels, -1).long()).view(channels, height, width)

    def _arith(self, x: torch.Tensor) -> torch.Tensor:
        """Rescale and normalize (transformers' float types and order) of uint8 ``x`` [C, ...]."""
        c = self.config
        if c.do_rescale:
            x = (x.to(torch.float64) * c.rescale_factor).to(torch.float32)
        else:
            x = x.to(torch.float32)
        if c.do_normalize:
            x = (x - self._mean) / self._std
        return x

    def _table(self, channels: int) -> torch.Tensor:
        """[channels, 256] float32: the result of each uint8 value in each channel."""
        if channels not in self._tables:
            values = torch.arange(256, dtype=torch.uint8).expand(channels, 256).contiguous()
            self._tables[channels] = self._arith(values).contiguous()
        return self._tables[channels]

