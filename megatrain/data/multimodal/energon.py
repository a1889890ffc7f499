"""Megatron's multimodal webdataset shards, read through megatron-energon (``pip install
megatrain[multimodal]``), as the same samples as the LLaVA jsonl dataset.

An energon dataset is a folder of tar shards (``00000.tar``: ``KEY.jpg`` + ``KEY.json``/``KEY.txt`` per
sample) with the ``.nv-meta`` folder that ``energon prepare`` writes: ``.info.json`` (samples per
shard), ``split.yaml`` (which shards are train/val/test), ``index.sqlite`` and the shards'
``.tar.idx`` offsets, and ``dataset.yaml`` (the sample type and which file gives which field, e.g.
``sample_type: {__module__: megatron.energon, __class__: VQASample}``,
``field_map: {image: jpg, context: json[question], answers: json[answers]}``).
:func:`prepare_dataset` writes them without the interactive command.

:class:`LlavaTaskEncoder` is an energon task encoder: it decodes images as PIL images (energon's
``SampleDecoder(image_decode="pil")``), turns a ``VQASample`` (``<image>\\n{context}`` -> the first
answer) or a ``CaptioningSample`` (``<image>\\n{caption_prompt}`` -> the caption) into a LLaVA
conversation and makes the sample exactly as :class:`LlavaJsonlDataset` makes it (the same
:class:`ConversationEncoder` and :class:`CLIPImageProcessor`); batches are
:class:`MultimodalBatch` (:class:`MultimodalCollator`). :func:`get_train_dataset` is energon's
``get_train_dataset`` with this encoder: energon's own order (shard shuffling with a shuffle buffer)
and its own resumable state (``get_savable_loader(...).save_state_rank()``), not megatrain's index.

Both sample types carry one ``image``, so a sample here has one image (``num_images`` 1); several
images per sample come from the jsonl dataset only (energon's ``InterleavedSample`` is not read).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from megatrain.data.multimodal.collate import MultimodalBatch, MultimodalCollator
from megatrain.data.multimodal.conversation import IMAGE_PLACEHOLDER, ConversationEncoder
from megatrain.data.multimodal.errors import MultimodalDataError
from megatrain.data.multimodal.image_processing import CLIPImageProcessor

try:
    import megatron.energon as energon
except ImportError as _e:  # the optional dependency
    energon = None
    _IMPORT_ERROR: ImportError | None = _e
else:
    _IMPORT_ERROR = None

__all__ = ["LlavaTaskEncoder", "get_train_dataset", "prepare_dataset", "to_conversation", "energon_available"]


def energon_available() -> bool:
    return energon is not None


def _need_energon() -> Any:
    if energon is None:
        raise ImportError("reading energon datasets needs megatron-energon: pip install 'megatrain[multimodal]' "
                          f"({_IMPORT_ERROR})")
    return energon


def _with_placeholder(text: str) -> str:
    return text if IMAGE_PLACEHOLDER in text else f"{IMAGE_PLACEHOLDER}\n{text}"


def to_conversation(sample: Any, caption_prompt: str) -> tuple[list[dict[str, str]], Any]:
    """(LLaVA conversation, image) of an energon ``VQASample`` or ``CaptioningSample``."""
    e = _need_energon()
    where = f"energon sample {getattr(sample, '__key__', '?')}"
    if isinstance(sample, e.VQASample):
        answers = sample.answers or []
        if not answers:
            raise MultimodalDataError("VQASample without answers: nothing to train on", where, "conversation")
        if sample.answer_weights is not None and len(sample.answer_weights) == len(answers):
            answer = answers[int(max(range(len(answers)), key=lambda k: float(sample.answer_weights[k])))]
        else:
            answer = answers[0]
        turns = [{"from": "human", "value": _with_placeholder(str(sample.context))},
                 {"from": "gpt", "value": str(answer)}]
    elif isinstance(sample, e.CaptioningSample):
        turns = [{"from": "human", "value": _with_placeholder(caption_prompt)},
                 {"from": "gpt", "value": str(sample.caption)}]
    else:
        raise MultimodalDataError(f"energon sample type {type(sample).__name__} is not supported (VQASample, "
                                  "CaptioningSample)", where, "conversation")
    return turns, sample.image


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
        self.decoder = e.SampleDecoder(image_decode="pil")  # our processor converts and resizes, as for jsonl
        self.encoder, self.processor = encoder, processor or CLIPImageProcessor()
        self.caption_prompt = caption_prompt
        tok = encoder.tokenizer
        pad = pad_id if pad_id is not None else (tok.pad if getattr(tok, "pad", None) is not None else tok.eod)
        self.collator = MultimodalCollator(pad, encoder.seq_length if pad_to_seq_length else None,
                                           self.processor.output_shape)

    @_stateless
    def encode_sample(self, sample: Any) -> dict[str, Any]:
        turns, image = to_conversation(sample, self.caption_prompt)
        where = f"energon sample {sample.__key__}"
        try:
            pixel_values = self.processor(image).unsqueeze(0)
        except (OSError, ValueError) as err:
            raise MultimodalDataError(f"image: cannot process it ({err})", where, "image") from None
        encoded = self.encoder.encode(turns, 1, where)
        return {"tokens": encoded.tokens, "targets": encoded.targets, "pixel_values": pixel_values,
                "num_images": 1, "id": str(sample.__key__), "skipped": 0,
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
    ``get_loader``/``get_savable_loader``."""
    e = _need_energon()
    if worker_config is None:
        worker_config = e.WorkerConfig(rank=0, world_size=1, num_workers=0)
    return e.get_train_dataset(path, worker_config=worker_config, batch_size=batch_size,
                               shuffle_buffer_size=shuffle_buffer_size,
                               max_samples_per_sequence=max_samples_per_sequence, task_encoder=task_encoder,
                               **kwargs)


def prepare_dataset(path: str, shards: Sequence[str], sample_type: str, field_map: dict[str, str],
                    split_ratio: Sequence[float] = (1.0, 0.0, 0.0), shuffle_seed: int | None = 42,
                    workers: int = 1) -> None:
    """What ``energon prepare PATH --non-interactive --split-ratio ... --sample-type T --field-map ...``
    writes: the shards' index, ``.nv-meta/split.yaml``, ``.info.json`` and ``dataset.yaml``.
    ``shards``: tar paths relative to ``path``."""
    e = _need_energon()
    import yaml

    if not hasattr(e, sample_type) or not isinstance(getattr(e, sample_type), type):
        raise ValueError(f"{sample_type!r} is not an energon sample type (e.g. VQASample, CaptioningSample)")
    split = [("train", float(split_ratio[0])), ("val", float(split_ratio[1])), ("test", float(split_ratio[2]))]
    e.BaseWebdatasetFactory.prepare_dataset(path, list(shards), split_parts_ratio=split, shuffle_seed=shuffle_seed,
                                            workers=workers)
    definition = {"sample_type": {"__module__": "megatron.energon", "__class__": sample_type},
                  "field_map": dict(field_map)}
    with open(os.path.join(path, ".nv-meta", "dataset.yaml"), "w", encoding="utf-8") as f:
        yaml.dump(definition, f, sort_keys=False)
