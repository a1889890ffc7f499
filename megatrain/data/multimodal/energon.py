"""Megatron's multimodal webdataset shards, read through megatron-energon (``pip install
megatrain[multimodal]``), as the same samples as the LLaVA jsonl dataset, with one or several images.

An energon dataset is a folder of tar shards (``00000.tar``: ``KEY.jpg`` + ``KEY.json``/``KEY.txt`` per
sample, or ``KEY.0.jpg``, ``KEY.1.png``, ... for several images) with the ``.nv-meta`` folder that
``energon prepare`` writes: ``.info.json`` (samples per shard), ``split.yaml`` (which shards are
train/val/test), ``index.sqlite`` and the shards' ``.tar.idx`` offsets, and ``dataset.yaml`` (the sample
type and which file gives which field, e.g. ``sample_type: {__module__: megatron.energon, __class__:
VQASample}``, ``field_map: {image: jpg, context: json[question], answers: json[answers]}``; or, where a
field takes several files, ``sample_loader: sample_loader.py:sample_loader`` and ``part_filter:
sample_loader.py:part_filter``, functions of ``.nv-meta/sample_loader.py``). :func:`prepare_dataset`
writes them without the interactive command; :data:`LLAVA_SAMPLE_LOADER` is a ``sample_loader.py`` for
shards of LLaVA jsonl lines (``KEY.json`` a line's object, its images ``KEY.jpg`` or ``KEY.0.jpg``,
``KEY.1.jpg``, ...) as ``SimilarityInterleavedSample``.

:class:`LlavaTaskEncoder` is an energon task encoder: it decodes images as PIL images in the file's
own mode (energon's ``SampleDecoder`` with ``"pil"``, less its conversion to RGB), turns a sample into a
LLaVA conversation and its images (:func:`to_conversation`, as Megatron-LM's
``examples/multimodal/dataset_helpers.py`` lays them out) and makes the sample exactly as
:class:`LlavaJsonlDataset` makes it (the same :class:`ConversationEncoder` and
:class:`CLIPImageProcessor`; ``pixel_values`` [k, 3, H, W] in the order of the ``<image>``
placeholders, ``num_images`` k). The sample types it reads:

* ``SimilarityInterleavedSample`` (Megatron's LLaVA SFT, several images): ``texts`` are the LLaVA
  turns (``{"from": "human" | "gpt", "value": ...}``), ``images`` the images. As Megatron: an
  ``<image-N>`` tag in a human turn is image N (1-based), the images taken in the tags' order; one
  image with several placeholders is repeated for each; a sample without images has its
  placeholders removed (text only); fewer placeholders than images puts the missing ones
  (``<image><image>...\\n``) at the start of the first human turn; more placeholders than images is
  an error. Texts that are plain strings (an interleaved document matched to its images by
  similarity) are refused: there are no turns to train on.
* ``VQASample``: ``<image>\\n{context}`` -> the answer (a string, or the list's answer of highest
  ``answer_weights``, else its first); ``image`` one image or a list of them (the missing
  placeholders put first as above).
* ``MultiChoiceVQASample``: Megatron's prompt, ``{context}\\nA. {choice}\\nB. ...\\nAnswer with the
  option's letter from the given choices directly.`` -> the letter of ``correct_choice_idx``.
* ``CaptioningSample``: ``<image>\\n{caption_prompt}`` -> the caption.

Megatron adds a system turn (``Answer the questions.``), draws VQA answers and prompts at random and,
for a ``VQASample`` whose key holds ``llava`` (or with the ``is_llava_training`` subflavor), drops its
context (the human turn is ``<image>\n`` alone); megatrain does none of these, so a sample is the jsonl
line with the same turns and images. Other types
(``InterleavedSample``, ``OCRSample``, crude samples, ...) stop with one line naming the type and the
dataset folder: when the dataset is opened (from ``dataset.yaml``) or, failing that, at its first sample.

A **metadataset** (a ``.yaml`` file, ``__module__: megatron.energon``, ``__class__: Metadataset`` or
``MetadatasetV2``, ``splits: {train: {datasets: [{weight, path, subflavors}]}, val: ...}``, as Megatron's
``examples/multimodal/pretrain_dataset.yaml``) is read by energon itself; :func:`metadataset_datasets`
lists the dataset folders a split names (relative paths resolved against the yaml's folder, as energon
resolves them) and :func:`check_energon_path` checks each one's sample type, so that a metadataset that
does not parse, names a missing folder or a type megatrain does not read is one line naming the file.

Batches are :class:`MultimodalBatch` (:class:`MultimodalCollator`). :func:`get_train_dataset` is
energon's ``get_train_dataset`` with this encoder: energon's own order (shard shuffling with a shuffle
buffer) and its own resumable state (``get_savable_loader(...).save_state_rank()``), not megatrain's index.
"""

from __future__ import annotations

import importlib
import io
import os
import re
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from megatrain.data.multimodal.collate import MultimodalBatch, MultimodalCollator
from megatrain.data.multimodal.conversation import IMAGE_PLACEHOLDER, ROLES, ConversationEncoder
from megatrain.data.multimodal.errors import MultimodalDataError
from megatrain.data.multimodal.image_processing import CLIPImageProcessor

try:
    import megatron.energon as energon
except ImportError as _e:  # the optional dependency
    energon = None
    _IMPORT_ERROR: ImportError | None = _e
else:
    _IMPORT_ERROR = None

__all__ = ["LlavaTaskEncoder", "get_train_dataset", "prepare_dataset", "to_conversation", "energon_available",
           "READ_SAMPLE_TYPES", "LLAVA_SAMPLE_LOADER", "dataset_sample_type", "check_sample_type", "where_of",
           "is_metadataset", "metadataset_datasets", "check_energon_path", "split_length", "get_val_dataset"]

#: The energon sample types :func:`to_conversation` reads (Megatron's multimodal example reads these too).
READ_SAMPLE_TYPES = ("SimilarityInterleavedSample", "VQASample", "MultiChoiceVQASample", "CaptioningSample")

#: ``.nv-meta/sample_loader.py`` for shards of LLaVA jsonl lines: ``KEY.json`` a line's object (its
#: ``conversations``), its images ``KEY.jpg`` (one) or ``KEY.0.jpg``, ``KEY.1.png``, ... (several, in the
#: number's order), as a ``SimilarityInterleavedSample`` (``prepare_dataset(..., sample_loader=...)``).
LLAVA_SAMPLE_LOADER = '''\
# A LLaVA jsonl line per sample: KEY.json (the line's object), KEY.jpg or KEY.0.jpg, KEY.1.png, ... (megatrain)
import re

_IMAGE = re.compile(r"^(?:(\\d+)\\.)?(?:jpg|jpeg|png|webp|bmp|gif|tif|tiff)$", re.IGNORECASE)


def sample_loader(raw: dict) -> dict:
    images = sorted((int(m.group(1) or -1), part) for part in raw if isinstance(part, str)
                    for m in [_IMAGE.match(part)] if m)
    line = raw.get("json")
    texts = line.get("conversations") if isinstance(line, dict) else None  # megatrain names what is wrong
    return dict(images=[raw[part] for _, part in images], texts=texts)


def part_filter(part: str) -> bool:
    return part == "json" or _IMAGE.match(part) is not None
'''

_IMAGE_TAG = re.compile(r"<image-(\d+)>")
_MULTICHOICE_INSTRUCTION = "Answer with the option's letter from the given choices directly."


def energon_available() -> bool:
    return energon is not None


def _need_energon() -> Any:
    if energon is None:
        raise ImportError("reading energon datasets needs megatron-energon: pip install 'megatrain[multimodal]' "
                          f"({_IMPORT_ERROR})")
    return energon


def _read_types() -> tuple[type, ...]:
    e = _need_energon()
    return tuple(getattr(e, name) for name in READ_SAMPLE_TYPES)


def _refusal(type_name: str) -> str:
    hint = ""
    if type_name in ("InterleavedSample", "InterleavedWebdataset"):
        hint = ("; an InterleavedSample has text and images without speaker turns (Megatron's multimodal example "
                "does not read it either): give a SimilarityInterleavedSample, its texts the LLaVA turns and its "
                "images the list (LLAVA_SAMPLE_LOADER reads shards of LLaVA jsonl lines so)")
    return (f"energon sample type {type_name} is not read by megatrain (it reads {', '.join(READ_SAMPLE_TYPES)})"
            f"{hint}")


def where_of(sample: Any) -> str:
    """``energon DATASET/SHARD: sample KEY`` (energon's source information), else ``energon sample KEY``."""
    key = getattr(sample, "__key__", "?")
    sources = getattr(sample, "__sources__", None) or ()
    if sources:
        source = sources[0]
        return f"energon {source.dataset_path}/{source.shard_name}: sample {key}"
    return f"energon sample {key}"


def _images(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _is_human(turn: Any) -> bool:
    return (isinstance(turn, dict) and isinstance(turn.get("value"), str) and isinstance(turn.get("from"), str)
            and ROLES.get(turn["from"].lower()) == "user")


def _put_missing_placeholders(turns: list[dict[str, Any]], num_images: int) -> None:
    """Megatron's rule: fewer ``<image>`` in the human turns than images puts the missing ones
    (``<image><image>...\\n``) at the start of the first human turn."""
    present = sum(t["value"].count(IMAGE_PLACEHOLDER) for t in turns if _is_human(t))
    if present < num_images:
        for t in turns:
            if _is_human(t):
                t["value"] = IMAGE_PLACEHOLDER * (num_images - present) + "\n" + t["value"]
                break


def _single_turn(prompt: str, answer: str, images: list[Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    turns = [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]
    _put_missing_placeholders(turns, len(images))
    return turns, images


def _vqa_answer(sample: Any, where: str) -> str:
    answers = sample.answers
    if isinstance(answers, str):
        return answers
    answers = list(answers or [])
    if not answers:
        raise MultimodalDataError("VQASample without answers: nothing to train on", where, "conversation")
    weights = sample.answer_weights
    if weights is not None and len(weights) == len(answers):
        return str(answers[int(max(range(len(answers)), key=lambda k: float(weights[k])))])
    return str(answers[0])


def _multichoice(sample: Any, where: str) -> tuple[str, str]:
    choices = list(sample.choices or [])
    if not choices:
        raise MultimodalDataError("MultiChoiceVQASample without choices", where, "conversation")
    index = int(sample.correct_choice_idx)
    if not 0 <= index < len(choices):
        raise MultimodalDataError(f"MultiChoiceVQASample correct_choice_idx {index} is not one of its "
                                  f"{len(choices)} choices", where, "conversation")
    options = "".join(f"{chr(ord('A') + i)}. {choice}\n" for i, choice in enumerate(choices))
    return f"{sample.context}\n{options}{_MULTICHOICE_INSTRUCTION}", chr(ord("A") + index)


def _llava_sft(sample: Any, where: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """A ``SimilarityInterleavedSample`` as Megatron's ``encode_llava_sft`` lays it out (module docstring)."""
    texts = sample.texts
    if texts is None:
        raise MultimodalDataError("SimilarityInterleavedSample without texts (LLAVA_SAMPLE_LOADER: KEY.json must "
                                  "be a LLaVA line, an object with \"conversations\")", where, "conversation")
    if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, dict) for t in texts):
        raise MultimodalDataError("SimilarityInterleavedSample texts must be LLaVA turns ({\"from\": \"human\" | "
                                  "\"gpt\", \"value\": ...}, Megatron's LLaVA SFT layout); plain-text entries (a "
                                  "document matched to its images by similarity) have no turns to train on",
                                  where, "conversation")
    turns = [dict(t) for t in texts]
    images = _images(sample.images)
    tags: list[int] = []
    placeholders = 0
    for t in turns:
        if _is_human(t):
            tags += [int(n) - 1 for n in _IMAGE_TAG.findall(t["value"])]
            t["value"] = _IMAGE_TAG.sub(IMAGE_PLACEHOLDER, t["value"])
            placeholders += t["value"].count(IMAGE_PLACEHOLDER)
    if tags:
        bad = [n + 1 for n in tags if not 0 <= n < len(images)]
        if bad:
            raise MultimodalDataError(f"<image-{bad[0]}> names image {bad[0]} but the sample has {len(images)} "
                                      "images", where, "conversation")
        images = [images[n] for n in tags]
    if len(images) == 1 and placeholders > 1:  # one image, several places: the image at each
        images = images * placeholders
    if not images:  # text only: the placeholders go
        for t in turns:
            if _is_human(t):
                t["value"] = t["value"].replace(IMAGE_PLACEHOLDER, "")
        placeholders = 0
    if placeholders > len(images):
        raise MultimodalDataError(f"has {placeholders} {IMAGE_PLACEHOLDER} placeholders but {len(images)} images",
                                  where, "conversation")
    _put_missing_placeholders(turns, len(images))
    return turns, images


def to_conversation(sample: Any, caption_prompt: str, where: str | None = None) -> tuple[list[dict[str, str]],
                                                                                      list[Any]]:
    """(LLaVA conversation, its images in placeholder order) of an energon sample (module docstring);
    a type megatrain does not read raises one line naming it."""
    e = _need_energon()
    where = where or where_of(sample)
    if isinstance(sample, e.SimilarityInterleavedSample):
        return _llava_sft(sample, where)
    if isinstance(sample, e.VQASample):
        return _single_turn(str(sample.context), _vqa_answer(sample, where), _images(sample.image))
    if isinstance(sample, e.MultiChoiceVQASample):
        prompt, answer = _multichoice(sample, where)
        return _single_turn(prompt, answer, _images(sample.image))
    if isinstance(sample, e.CaptioningSample):
        return _single_turn(caption_prompt, str(sample.caption), _images(sample.image))
    raise MultimodalDataError(_refusal(type(sample).__name__), where, "conversation")


def _to_pil(image: Any, index: int, where: str) -> Image.Image:
    """A decoded image as PIL: PIL as it is, a uint8 or [0, 1] float tensor / array ([C, H, W] or
    [H, W]) as torchvision's ``ToPILImage`` reads it."""
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, (torch.Tensor, np.ndarray)):
        t = torch.as_tensor(image)
        if t.dim() == 3 and t.shape[0] in (1, 3, 4):
            t = t.permute(1, 2, 0)
        if t.dim() == 3 and t.shape[-1] == 1:
            t = t[..., 0]
        if t.is_floating_point():
            t = t.mul(255).byte()
        if t.dtype == torch.uint8 and t.dim() in (2, 3):
            return Image.fromarray(t.contiguous().numpy())
    raise MultimodalDataError(f"image {index}: expected a decoded image, got {type(image).__name__}"
                              f"{list(image.shape) if hasattr(image, 'shape') else ''}", where, "image")


def _import_class(module: str, name: str) -> type | None:
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None  # energon says why when it opens the dataset
    return found if isinstance(found, type) else None


def dataset_sample_type(path: str, dataset_config: str = "dataset.yaml") -> tuple[str, type | None] | None:
    """(name, class) of the sample type the energon dataset folder at ``path`` declares in
    ``.nv-meta/dataset.yaml`` (``sample_type``, or the older top-level ``__module__``/``__class__`` of a
    webdataset class); the class is None where it cannot be imported. None: no such file or field."""
    import yaml

    file = os.path.join(os.fspath(path), ".nv-meta", dataset_config)
    try:
        with open(file, encoding="utf-8") as f:
            definition = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(definition, dict):
        return None
    spec = definition.get("sample_type") if isinstance(definition.get("sample_type"), dict) else definition
    module, name = spec.get("__module__"), spec.get("__class__")
    if not isinstance(module, str) or not isinstance(name, str):
        return None
    cls = _import_class(module, name)
    sample_type = getattr(cls, "__sample_type__", None) if cls is not None else None
    if isinstance(sample_type, type):  # a webdataset class (VQAWebdataset): its sample type
        return sample_type.__name__, sample_type
    return name, cls


def check_sample_type(path: str, where: str) -> None:
    """One line (``WHERE: energon sample type T is not read ...``) when the dataset folder at ``path``
    declares a sample type :func:`to_conversation` does not read; nothing when it reads it or the
    folder does not say (the first sample is checked then)."""
    found = dataset_sample_type(path)
    if found is None:
        return
    name, cls = found
    if cls is None or not issubclass(cls, _read_types()):
        raise MultimodalDataError(_refusal(name), where, "conversation")


#: The file names energon's ``get_train_dataset`` takes as a metadataset (energon itself reads ``.yaml``).
METADATASET_SUFFIXES = (".yaml", ".yml")


def is_metadataset(path: str) -> bool:
    """Whether ``path`` names an energon metadataset (a ``.yaml``/``.yml`` file) rather than a dataset folder."""
    return os.fspath(path).lower().endswith(METADATASET_SUFFIXES)


def metadataset_datasets(path: str, split: str, where: str) -> list[str] | None:
    """The dataset folders the metadataset file at ``path`` names for ``split`` (energon's traversal:
    nested metadatasets followed, relative paths against the yaml's folder); None when the metadataset
    has no such split. A file that does not parse as an energon metadataset, or a named dataset that is
    not an energon dataset folder, raises one line (``WHERE: ...``)."""
    _need_energon()
    import yaml

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise MultimodalDataError("no such file (an energon metadataset .yaml)", where)
    if not path.lower().endswith(".yaml"):
        raise MultimodalDataError("energon reads a metadataset only from a file named *.yaml: rename it", where)
    try:
        with open(path, encoding="utf-8") as f:
            definition = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        mark = getattr(err, "problem_mark", None)
        first += f", line {mark.line + 1}" if mark is not None else ""
        raise MultimodalDataError(f"not a valid YAML file ({first})", where) from None
    splits = definition.get("splits") if isinstance(definition, dict) else None
    if (not isinstance(definition, dict) or definition.get("__module__") != "megatron.energon"
            or not isinstance(splits, dict)):
        raise MultimodalDataError("not an energon metadataset (expected __module__: megatron.energon, __class__: "
                                  "Metadataset or MetadatasetV2, and splits: {train: {datasets: [...]}, val: ...})",
                                  where)
    if split not in splits:
        return None
    from megatron.energon.flavors.webdataset.metadata import check_dataset_info_present
    from megatron.energon.metadataset.loader import traverse_metadataset

    try:
        refs = traverse_metadataset(path, split_part=split)
    except Exception as err:  # energon's parser: TypeError, AssertionError, KeyError, ... of the yaml's content
        detail = " ".join(str(err).split())[:300] or type(err).__name__
        raise MultimodalDataError(f"cannot read the energon metadataset's {split} split ({type(err).__name__}: "
                                  f"{detail})", where) from None
    folders = []
    for ref in refs:
        folder = str(ref.path)
        if not os.path.isdir(folder):
            raise MultimodalDataError(f"the {split} split names the dataset {folder}, which does not exist (paths "
                                      "are relative to the yaml's folder)", where)
        if not check_dataset_info_present(ref.path):
            raise MultimodalDataError(f"the {split} split names {folder}, which is not a prepared energon dataset "
                                      "(no .nv-meta/.info.json: run `energon prepare` on it)", where)
        folders.append(folder)
    return folders


def check_energon_path(path: str, where: str, split: str = "train") -> list[str] | None:
    """Check an energon dataset folder, or each folder a metadataset's ``split`` names, for a sample
    type megatrain reads (:func:`check_sample_type`); the folders, or None for a metadataset without
    ``split``."""
    if is_metadataset(path):
        folders = metadataset_datasets(path, split, where)
        for folder in folders or ():
            check_sample_type(folder, f"{where} (its {split} dataset {folder})")
        return folders
    check_sample_type(path, where)
    return [os.fspath(path)]


def _empty_dataset_error() -> tuple[type, ...]:
    try:
        from megatron.energon.flavors.webdataset.empty_dataset_error import EmptyDatasetError
    except ImportError:  # pragma: no cover - other energon versions
        return ()
    return (EmptyDatasetError,)


def get_val_dataset(path: str, task_encoder: Any, *, split: str = "val", batch_size: int | None = None,
                    worker_config: Any = None, **kwargs: Any) -> Any:
    """energon's ``get_val_dataset`` (no shuffling: the split's samples in their stored order, once)
    of the dataset folder or metadataset at ``path`` with ``task_encoder``."""
    e = _need_energon()
    if worker_config is None:
        worker_config = e.WorkerConfig(rank=0, world_size=1, num_workers=0)
    return e.get_val_dataset(path, split_part=split, worker_config=worker_config, batch_size=batch_size,
                             task_encoder=task_encoder, **kwargs)


def split_length(path: str, split: str, where: str) -> int:
    """Samples in ``split`` of the energon dataset folder or metadataset at ``path`` (0: no such split,
    or no shards in it)."""
    e = _need_energon()
    if is_metadataset(path) and metadataset_datasets(path, split, where) is None:
        return 0
    try:
        return len(get_val_dataset(path, e.DefaultTaskEncoder(), split=split))
    except _empty_dataset_error():
        return 0
    except (OSError, ValueError, KeyError, AssertionError) as err:
        raise MultimodalDataError(f"cannot open the energon dataset's {split} split ({type(err).__name__}: {err})",
                                  where) from None


class _OpenedImage:
    """A webdataset image handler giving the PIL image in the file's own mode, so that the processor
    converts it as for the jsonl dataset (transparency onto white); energon's ``"pil"`` converts to
    RGB first, dropping the transparency."""

    def __init__(self, extensions: Any):
        self.extensions = set(extensions)

    def __call__(self, key: str, data: bytes) -> Image.Image | None:
        if re.sub(r".*[.]", "", key).lower() not in self.extensions:
            return None
        with io.BytesIO(data) as stream:
            image = Image.open(stream)
            image.load()
        return image


def _image_decoder(e: Any) -> Any:
    """energon's ``SampleDecoder(image_decode="pil")`` with its image handler giving images as opened."""
    decoder = e.SampleDecoder(image_decode="pil")
    handlers = getattr(getattr(decoder, "_decoder", None), "handlers", None)
    try:
        from webdataset.autodecode import ImageHandler
    except ImportError:  # pragma: no cover - energon depends on webdataset
        return decoder
    if isinstance(handlers, list):
        decoder._decoder.handlers = [_OpenedImage(h.extensions) if isinstance(h, ImageHandler) else h
                                     for h in handlers]
    return decoder


_TaskEncoderBase: Any = energon.TaskEncoder if energon is not None else object


def _stateless(fn: Any) -> Any:
    """energon's ``@stateless`` (the encoding keeps no state, so a restored loader needs none)."""
    return energon.stateless(fn) if energon is not None else fn


class LlavaTaskEncoder(_TaskEncoderBase):
    """energon samples -> megatrain's multimodal samples; batches -> :class:`MultimodalBatch`."""

    def __init__(self, encoder: ConversationEncoder, processor: CLIPImageProcessor | None = None,
                 pad_id: int | None = None, pad_to_seq_length: bool = False,
                 caption_prompt: str = "Write a terse but informative summary of the picture."):
        e = _need_energon()
        super().__init__()
        self.decoder = _image_decoder(e)  # PIL images as opened: our processor converts and resizes, as for jsonl
        self.encoder, self.processor = encoder, processor or CLIPImageProcessor()
        self.caption_prompt = caption_prompt
        tok = encoder.tokenizer
        pad = pad_id if pad_id is not None else (tok.pad if getattr(tok, "pad", None) is not None else tok.eod)
        self.collator = MultimodalCollator(pad, encoder.seq_length if pad_to_seq_length else None,
                                           self.processor.output_shape)

    def _pixels(self, image: Any, index: int, where: str) -> torch.Tensor:
        try:
            return self.processor(_to_pil(image, index, where))
        except (OSError, ValueError) as err:
            if isinstance(err, MultimodalDataError):
                raise
            raise MultimodalDataError(f"image {index}: cannot process it ({err})", where, "image") from None

    @_stateless
    def encode_sample(self, sample: Any) -> dict[str, Any]:
        where = where_of(sample)
        turns, images = to_conversation(sample, self.caption_prompt, where)
        # the text first, as the jsonl dataset: a sample that cannot fit is refused before its images
        encoded = self.encoder.encode(turns, len(images), where)
        if images:
            pixel_values = torch.stack([self._pixels(image, i, where) for i, image in enumerate(images)])
        else:
            pixel_values = torch.empty((0, *self.processor.output_shape), dtype=torch.float32)
        return {"tokens": encoded.tokens, "targets": encoded.targets, "pixel_values": pixel_values,
                "num_images": int(pixel_values.shape[0]), "id": str(sample.__key__), "skipped": 0,
                # energon's restore key, so that a saved loader state can find the sample again
                "__key__": sample.__key__, "__restore_key__": sample.__restore_key__}

    def batch(self, samples: Sequence[dict[str, Any]]) -> MultimodalBatch:
        return self.collator(samples)

    @_stateless
    def encode_batch(self, batch: MultimodalBatch) -> MultimodalBatch:
        return batch


def get_train_dataset(path: str, task_encoder: LlavaTaskEncoder, *, batch_size: int | None = None,
                      shuffle_buffer_size: int | None = 100, max_samples_per_sequence: int | None = 100,
                      worker_config: Any = None, **kwargs: Any) -> Any:
    """energon's ``get_train_dataset`` of the prepared dataset at ``path`` with ``task_encoder`` (a single
    process, no loader workers, unless ``worker_config`` says otherwise). Iterate it with energon's
    ``get_loader``/``get_savable_loader``. A dataset folder whose sample type megatrain does not read
    raises one line naming the type and the folder (:func:`check_sample_type`)."""
    e = _need_energon()
    if os.path.isdir(os.fspath(path)) or is_metadataset(path):
        check_energon_path(path, os.fspath(path))
    if worker_config is None:
        worker_config = e.WorkerConfig(rank=0, world_size=1, num_workers=0)
    return e.get_train_dataset(path, worker_config=worker_config, batch_size=batch_size,
                               shuffle_buffer_size=shuffle_buffer_size,
                               max_samples_per_sequence=max_samples_per_sequence, task_encoder=task_encoder,
                               **kwargs)


def prepare_dataset(path: str, shards: Sequence[str], sample_type: str, field_map: dict[str, str] | None = None,
                    split_ratio: Sequence[float] = (1.0, 0.0, 0.0), shuffle_seed: int | None = 42,
                    workers: int = 1, sample_loader: str | None = None) -> None:
    """What ``energon prepare PATH --non-interactive --split-ratio ... --sample-type T --field-map ...``
    writes: the shards' index, ``.nv-meta/split.yaml``, ``.info.json`` and ``dataset.yaml``.
    ``shards``: tar paths relative to ``path``. Either ``field_map`` (sample field -> the file giving
    it) or ``sample_loader``: the source of a ``sample_loader.py`` with ``sample_loader(raw) -> dict``
    and ``part_filter(part) -> bool`` (what energon's interactive command has one write where a field
    takes several files, e.g. :data:`LLAVA_SAMPLE_LOADER`), written to ``.nv-meta/sample_loader.py``."""
    e = _need_energon()
    import yaml

    if not hasattr(e, sample_type) or not isinstance(getattr(e, sample_type), type):
        raise ValueError(f"{sample_type!r} is not an energon sample type (e.g. {', '.join(READ_SAMPLE_TYPES)})")
    if (field_map is None) == (sample_loader is None):
        raise ValueError("give either field_map or sample_loader (the source of a sample_loader.py)")
    split = [("train", float(split_ratio[0])), ("val", float(split_ratio[1])), ("test", float(split_ratio[2]))]
    e.BaseWebdatasetFactory.prepare_dataset(path, list(shards), split_parts_ratio=split, shuffle_seed=shuffle_seed,
                                            workers=workers)
    definition: dict[str, Any] = {"sample_type": {"__module__": "megatron.energon", "__class__": sample_type}}
    if field_map is not None:
        definition["field_map"] = dict(field_map)
    else:
        with open(os.path.join(path, ".nv-meta", "sample_loader.py"), "w", encoding="utf-8") as f:
            f.write(sample_loader)
        definition["sample_loader"] = "sample_loader.py:sample_loader"
        definition["part_filter"] = "sample_loader.py:part_filter"
    with open(os.path.join(path, ".nv-meta", "dataset.yaml"), "w", encoding="utf-8") as f:
        yaml.dump(definition, f, sort_keys=False)
