"""LLaVA's jsonl data (``llava_v1_5_mix665k.json`` as jsonl, ``blip_laion_cc_sbu_558k``): one sample per
line, its image from an image folder, the loss on the answers.

Each non-blank line is an object::

    {"id": "000000033471", "image": "coco/train2017/000000033471.jpg",
     "conversations": [{"from": "human", "value": "<image>\\nWhat are the colors of the bus?"},
                       {"from": "gpt", "value": "The bus is white and red."}, ...]}

``image`` is a path relative to ``image_folder`` (or absolute), or a non-empty list of them for
several images per sample (LLaVA-OneVision / LLaVA-NeXT interleaved data): the ``i``-th ``<image>`` of
the human turns is the ``i``-th path, and the numbers must be equal. A line without it (or ``null``) is
a text-only sample; an empty list is refused. The conversation is tokenized by
:class:`megatrain.data.multimodal.conversation.ConversationEncoder` and the image preprocessed by
:class:`megatrain.data.multimodal.image_processing.CLIPImageProcessor`.

Sample ``i`` is line ``order(epoch)[pos]`` with ``epoch, pos = divmod(i, lines)`` and ``order(e)`` the
permutation of ``numpy.random.RandomState(seed + e)`` (as megatrain's SFT dataset), so the order is
fixed by the seed and a resumed run continues from its consumed-sample count (megatrain's loader
starts at that index): nothing else is state.

A sample is a dict: ``tokens`` and ``targets`` (int64 [n], n <= seq_length + 1; see
:class:`EncodedConversation`), ``pixel_values`` (float32 [k, 3, H, W], k = ``num_images``, the images in
the order of their placeholders), ``id`` (the line's ``id`` as a string, else ``FILE:LINE``),
``where`` (``FLAG FILE:LINE``, for error lines) and ``skipped`` (bad lines passed over to reach it).
:meth:`LlavaJsonlDataset.text_sample` is a sample without its images (packing measures samples by it).
:class:`megatrain.data.multimodal.collate.MultimodalCollator` batches them.

Errors (:class:`MultimodalDataError`, one line): a line that is not JSON, not an object, lacks
``conversations`` or has a malformed one, a malformed ``image`` (an empty list, an entry that is not a
path) or an ``<image>`` count not matching it stops the dataset when it is built (``--data-path
FILE:LINE: ...``). A missing or unreadable image (any of a sample's) stops the run when the sample is
read (``--data-path FILE:LINE: image PATH: ...``), or, with ``skip_bad_samples``, the sample is passed
over for the next line of the same epoch's order and counted (``skipped``, and :attr:`bad_lines` in the
reading process); so are samples whose image tokens do not fit ``seq_length``. ``check_images`` opens
every image when the dataset is built: bad ones stop it then, or are left out of the order and counted
(exact counts, at the cost of reading every image once).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
import torch
from PIL import Image

from megatrain.data.jsonl import iter_jsonl_at, parse_jsonl_line
from megatrain.data.multimodal.conversation import ConversationEncoder, check_placeholders, to_messages
from megatrain.data.multimodal.errors import MultimodalDataError
from megatrain.data.multimodal.image_processing import CLIPImageProcessor, ImageReadError, read_image

__all__ = ["LlavaJsonlDataset", "load_image", "SKIPPABLE"]

#: The kinds of bad samples that ``skip_bad_samples`` passes over.
SKIPPABLE = ("image", "length")


def load_image(path: str, where: str) -> Image.Image:
    """The decoded image at ``path``; missing or undecodable raises one line naming ``where`` and ``path``."""
    try:
        return read_image(path)
    except ImageReadError as e:
        what = {"missing": "no such file", "directory": "is a directory"}.get(e.kind, f"cannot read it ({e.detail})")
        raise MultimodalDataError(f"image {path}: {what}", where, "image") from None


def _check_line(obj: Any, where: str) -> list[str]:
    """The line's image paths in order (``[]``: text only); a line that is not LLaVA's form raises.

    ``image`` is one path, a non-empty list of paths (several images, the ``i``-th ``<image>`` of the
    human turns being the ``i``-th path), or absent / ``null`` (text only); the number of ``<image>``
    placeholders must equal the number of paths."""
    if not isinstance(obj, dict):
        raise MultimodalDataError(f"expected a JSON object with \"conversations\", got {type(obj).__name__}",
                                  where, "json")
    if "conversations" not in obj:
        keys = ", ".join(map(repr, list(obj)[:5]))
        raise MultimodalDataError(f"no \"conversations\" list (the keys are {keys or 'none'})", where, "json")
    messages = to_messages(obj["conversations"], where)
    image = obj.get("image")
    if image is None:
        images: list[str] = []
    elif isinstance(image, str) and image:
        images = [image]
    elif isinstance(image, list):
        if not image:
            raise MultimodalDataError("\"image\" is an empty list: give one or more paths relative to the image "
                                      "folder, or leave \"image\" out (or null) for a text-only sample", where, "json")
        for i, item in enumerate(image):
            if not isinstance(item, str) or not item:
                raise MultimodalDataError(f"\"image\" entry {i} must be a path relative to the image folder, got "
                                          f"{item!r}", where, "json")
        images = list(image)
    else:
        raise MultimodalDataError(f"\"image\" must be a path relative to the image folder (or a list of them), got "
                                  f"{image!r}", where, "json")
    check_placeholders(messages, len(images), where)
    return images


class LlavaJsonlDataset(torch.utils.data.Dataset):
    """The samples of one LLaVA jsonl file (module docstring). ``num_samples``: None for one epoch."""

    def __init__(self, path: str, image_folder: str | None, encoder: ConversationEncoder,
                 processor: CLIPImageProcessor | None = None, *, num_samples: int | None = None, seed: int = 1234,
                 skip_bad_samples: bool = False, check_images: bool = False, flag: str = "--data-path"):
        self.path, self.flag = os.fspath(path), flag
        self.image_folder = os.fspath(image_folder) if image_folder is not None else None
        self.encoder, self.processor = encoder, processor or CLIPImageProcessor()
        self.seed, self.skip_bad_samples = int(seed), bool(skip_bad_samples)
        self.image_shape = self.processor.output_shape
        #: line number -> reason, for the lines passed over (in this process).
        self.bad_lines: dict[int, str] = {}
        linenos, offsets, lengths = [], [], []
        for lineno, offset, length, obj in iter_jsonl_at(self.path, flag):
            where = f"{flag} {self.path}:{lineno}"
            images = _check_line(obj, where)
            for image in images:
                if self.image_folder is None and not os.path.isabs(image):
                    raise MultimodalDataError(f"\"image\" {image!r} is relative but no image folder was given",
                                              where, "json")
            if check_images and images:
                try:
                    for image in images:
                        load_image(self._image_path(image), where).close()
                except MultimodalDataError as e:
                    if not self.skip_bad_samples:
                        raise
                    self._note_bad(lineno, str(e), warn=False)
                    continue
            linenos.append(lineno)
            offsets.append(offset)
            lengths.append(length)
        if self.bad_lines:
            warnings.warn(f"{flag} {self.path}: {len(self.bad_lines)} lines with an unreadable image are left out "
                          f"(the first: {next(iter(self.bad_lines.values()))})", stacklevel=2)
        if not linenos:
            raise MultimodalDataError("no samples (the file is empty, or every image is bad)", f"{flag} {self.path}")
        self.linenos = np.asarray(linenos, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.num_samples = len(self.linenos) if num_samples is None else int(num_samples)
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self._orders: dict[int, np.ndarray] = {}
        self._file: Any = None
        self._file_pid = -1

    @property
    def num_lines(self) -> int:
        return len(self.linenos)

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None, "_file_pid": -1}

    def _image_path(self, image: str) -> str:
        return image if os.path.isabs(image) or self.image_folder is None else os.path.join(self.image_folder, image)

    def _note_bad(self, lineno: int, reason: str, warn: bool = True) -> None:
        if lineno not in self.bad_lines:
            self.bad_lines[lineno] = reason
            if warn:
                warnings.warn(f"skipped: {reason}", stacklevel=3)

    def _pixels(self, rel: str, where: str) -> torch.Tensor:
        """The preprocessed image ``rel`` ([3, H, W]); a bad one raises naming its path."""
        path = self._image_path(rel)
        image = load_image(path, where)
        try:
            return self.processor(image)
        except (OSError, ValueError) as e:  # a truncated file can fail only when decoded further
            raise MultimodalDataError(f"image {path}: cannot process it ({e})", where, "image") from None
        finally:
            image.close()

    def order(self, epoch: int) -> np.ndarray:
        """The line indices of ``epoch`` in reading order."""
        if epoch not in self._orders:
            self._orders[epoch] = np.random.RandomState(self.seed + epoch).permutation(self.num_lines)
        return self._orders[epoch]

    def where(self, j: int) -> str:
        return f"{self.flag} {self.path}:{int(self.linenos[j])}"

    def read_line(self, j: int) -> dict[str, Any]:
        """The parsed object of line index ``j`` (read again from the file)."""
        if self._file is None or self._file_pid != os.getpid():  # one handle per (loader worker) process
            self._file, self._file_pid = open(self.path, "rb"), os.getpid()
        self._file.seek(int(self.offsets[j]))
        return parse_jsonl_line(self._file.read(int(self.lengths[j])), self.where(j))

    def sample_of_line(self, j: int) -> dict[str, Any]:
        """The sample of line index ``j`` (errors as the module docstring)."""
        where = self.where(j)
        obj = self.read_line(j)
        images = _check_line(obj, where)
        # the text first: a sample that cannot fit (kind "length") is refused before its images are decoded
        encoded = self.encoder.encode(obj["conversations"], len(images), where)
        pixel_values = torch.empty((0, *self.image_shape), dtype=torch.float32)
        if images:
            pixel_values = torch.stack([self._pixels(rel, where) for rel in images])
        sample_id = obj.get("id")
        return {"tokens": encoded.tokens, "targets": encoded.targets, "pixel_values": pixel_values,
                "num_images": int(pixel_values.shape[0]),
                "id": f"{self.path}:{int(self.linenos[j])}" if sample_id is None else str(sample_id),
                "where": where, "skipped": 0}

    def text_sample(self, index: int) -> dict[str, Any]:
        """Sample ``index``'s ``tokens``, ``targets``, ``num_images``, ``id`` and ``where``, its images left
        unread (with ``skip_bad_samples`` the whole sample is read: a bad image decides which line stands in)."""
        if self.skip_bad_samples:
            return {k: v for k, v in self[index].items() if k != "pixel_values"}
        epoch, pos = divmod(self._checked(index), self.num_lines)
        j = int(self.order(epoch)[pos])
        where = self.where(j)
        obj = self.read_line(j)
        images = _check_line(obj, where)
        encoded = self.encoder.encode(obj["conversations"], len(images), where)
        return {"tokens": encoded.tokens, "targets": encoded.targets, "num_images": len(images),
                "id": f"{self.path}:{int(self.linenos[j])}" if obj.get("id") is None else str(obj["id"]),
                "where": where}

    def _checked(self, index: int) -> int:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        return int(index) % self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        epoch, pos = divmod(self._checked(index), self.num_lines)
        order = self.order(epoch)
        for attempt in range(self.num_lines):
            j = int(order[(pos + attempt) % self.num_lines])
            try:
                sample = self.sample_of_line(j)
            except MultimodalDataError as e:
                if not self.skip_bad_samples or e.kind not in SKIPPABLE:
                    raise
                self._note_bad(int(self.linenos[j]), str(e))
                continue
            sample["skipped"] = attempt
            return sample
        raise MultimodalDataError(f"every line is bad (the first: {next(iter(self.bad_lines.values()))})",
                                  f"{self.flag} {self.path}")
