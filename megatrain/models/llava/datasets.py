"""The LLaVA family's datasets (``pretrain_vlm.py --data-path``): a LLaVA jsonl file with an image
folder, or a megatron-energon dataset folder, as map-style datasets whose ``collate_fn`` gives
:class:`megatrain.data.multimodal.MultimodalBatch` micro-batches.

* ``--data-path FILE.jsonl`` (or ``--train-data-path``; ``--valid-data-path`` for validation): LLaVA
  conversations (docs/multimodal.md), images relative to ``--image-folder`` (default: the file's
  folder); sample ``i`` is line ``permutation(seed + epoch)[pos]``, so megatrain's loader resumes it
  exactly from the consumed-sample count.
* ``--data-path DIR`` with ``DIR/.nv-meta`` (an energon dataset ``energon prepare`` wrote), or
  ``--data-path FILE.yaml``, an energon metadataset (Megatron's ``examples/multimodal/pretrain_dataset.yaml``:
  ``splits: {train: {datasets: [...]}, val: ...}``):
  :class:`megatrain.data.multimodal.energon_samples.EnergonSamples`, energon's seeded stream of the
  ``train`` split read in order (a resume reads past the consumed samples again). Validation, as
  Megatron's ``dataloader_provider`` (``get_val_datasets``): the ``val`` split, unshuffled, of
  ``--valid-data-path`` (Megatron's older ``--valid-path``) when given, else of ``--data-path`` when it
  has val samples (else no validation, with a note); ``--test-data-path`` reads its ``test`` split.
* ``--packing-buffer-size B --packing-seq-length P``: the dataset (either kind) wrapped in
  :class:`megatrain.data.multimodal.packing.PackedSamples`, so that a sample of the run (the loader's
  index, the consumed-sample count) is one pack of several samples; the underlying dataset is given
  ``B`` times the run's samples, more than its packs can read.

The tokens: each ``--special-tokens`` entry must be one token of the tokenizer. With ``<image>`` one
token, it is tokenized in place; without it (a plain BPE tokenizer) the text around it is tokenized
separately (megatrain's template only). Either way the image positions carry Megatron's placeholder
id -200, which the model replaces and never looks up.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from megatrain.data.multimodal.collate import MultimodalCollator
from megatrain.data.multimodal.conversation import IMAGE_PLACEHOLDER, ConversationEncoder, _single_token_id
from megatrain.data.multimodal.image_processing import CLIPImageProcessor
from megatrain.data.multimodal.llava_dataset import LlavaJsonlDataset
from megatrain.data.multimodal.packing import PackedSamples
from megatrain.models.llava.config import MEGATRON_IMAGE_TOKEN_ID
from megatrain.models.llava.flags import check_packing_args

__all__ = ["build_llava_datasets", "image_processor_from_args", "conversation_encoder"]


def image_processor_from_args(args: Any) -> CLIPImageProcessor:
    """CLIP preprocessing from ``--image-processor`` or CLIP's defaults at ``--img-h``; its output must
    be the ViT's ``--img-h`` x ``--img-w``."""
    processor = CLIPImageProcessor.from_pretrained(args.image_processor, size=args.img_h)
    shape = tuple(processor.output_shape)
    if shape != (args.num_channels, args.img_h, args.img_w):
        source = f"--image-processor {args.image_processor}" if args.image_processor else "CLIP's preprocessing"
        raise ValueError(f"{source} gives {shape[0]} x {shape[1]} x {shape[2]} images but the ViT reads "
                         f"--num-channels {args.num_channels} x --img-h {args.img_h} x --img-w {args.img_w}")
    return processor


def conversation_encoder(args: Any, tokenizer: Any) -> ConversationEncoder:
    for token in args.special_tokens or ():
        if token != IMAGE_PLACEHOLDER and _single_token_id(tokenizer, token) is None:
            raise ValueError(f"--special-tokens {token}: not one token of the tokenizer (--tokenizer-model "
                             f"{args.tokenizer_model}); add it to the tokenizer's special tokens")
    return ConversationEncoder(tokenizer, args.seq_length, image_token_id=MEGATRON_IMAGE_TOKEN_ID)


def _one_path(paths: Sequence[str] | None, flag: str) -> str | None:
    if not paths:
        return None
    if len(paths) != 1:
        raise ValueError(f"{flag}: give one LLaVA jsonl file or energon dataset folder, got {len(paths)} "
                         "(blends are not built for vision-language data)")
    return paths[0]


def _is_energon(path: str) -> bool:
    from megatrain.data.multimodal.energon import is_metadataset

    return os.path.isdir(path) or is_metadataset(path)


def _dataset(path: str, args: Any, encoder: ConversationEncoder, processor: CLIPImageProcessor,
             num_samples: int | None, flag: str, seed: int, tokens_per_image: int | None = None,
             split: str = "train") -> Any:
    """The dataset at ``path`` (an energon dataset's or metadataset's ``split``); packed
    (``tokens_per_image`` given) into ``num_samples`` packs."""
    packs = None
    if tokens_per_image is not None:
        packs = int(num_samples or 1)
        num_samples = packs * args.packing_buffer_size
    if _is_energon(path):
        if os.path.isdir(path) and not os.path.isdir(os.path.join(path, ".nv-meta")):
            raise ValueError(f"{flag} {path}: a folder without .nv-meta is not an energon dataset "
                             "(run `energon prepare` on it), and a LLaVA dataset is one .jsonl file")
        from megatrain.data.multimodal.energon_samples import EnergonSamples
        ds: Any = EnergonSamples(path, encoder, processor, num_samples=num_samples or 1, seed=seed, flag=flag,
                                 split=split)
    else:
        if not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
        folder = args.image_folder if args.image_folder is not None else os.path.dirname(os.path.abspath(path))
        ds = LlavaJsonlDataset(path, folder, encoder, processor, num_samples=num_samples, seed=seed, flag=flag)
    pad = tokenizer_pad(encoder.tokenizer)
    ds.collate_fn = MultimodalCollator(pad_id=pad, image_shape=processor.output_shape,
                                       tokens_per_image=tokens_per_image, image_token_id=encoder.image_token_id)
    if packs is not None and tokens_per_image is not None:
        ds = PackedSamples(ds, packing_seq_length=args.packing_seq_length, buffer_size=args.packing_buffer_size,
                           tokens_per_image=tokens_per_image, image_token_id=encoder.image_token_id, num_samples=packs)
    return ds


def tokenizer_pad(tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad", None)
    return int(pad if pad is not None and pad >= 0 else tokenizer.eod)


def build_llava_datasets(args: Any, tokenizer: Any, num_samples: Sequence[int | None]) -> tuple[Any, Any, Any]:
    """(train, valid, test) from ``--data-path`` / ``--train-data-path`` and ``--valid-data-path``
    (module docstring); valid and test are None without their flags."""
    encoder = conversation_encoder(args, tokenizer)
    processor = image_processor_from_args(args)
    tokens_per_image = None
    if check_packing_args(args):
        from megatrain.models.llava.family import llava_config_from_args

        tokens_per_image = llava_config_from_args(args, 1).tokens_per_image
    train_flag = "--train-data-path" if args.train_data_path else "--data-path"
    train = _one_path(args.train_data_path or args.data_path, train_flag)
    if train is None:
        raise ValueError("--data-path: give a LLaVA jsonl file (with --image-folder) or an energon dataset folder")
    out = [_dataset(train, args, encoder, processor, num_samples[0], train_flag, args.seed, tokens_per_image)]
    for flag, paths, n, split in (("--valid-data-path", args.valid_data_path, num_samples[1], "val"),
                                  ("--test-data-path", getattr(args, "test_data_path", None), num_samples[2], "test")):
        path = _one_path(paths, flag)
        if path is None and split == "val" and n and _is_energon(train):
            path, flag = _implicit_val(train, train_flag)
        if split == "val" and path is not None and flag == "--valid-data-path":
            flag = getattr(args, "valid_data_flag", None) or flag  # --valid-path, as the command line said
        if path is not None and n and _is_energon(path):
            count = _split_length(path, split, flag)
            if not count:
                raise ValueError(f"{flag} {path}: the energon dataset's {split} split has no samples ({split} data "
                                 f"reads the {split} split, as Megatron's get_val_datasets; prepare the dataset with "
                                 f"a {split} part, or name datasets under splits: {split}: in the metadataset)")
            if split == "val":
                _note(f"validation reads the val split of {flag} {path} ({count} samples, in order, unshuffled)")
        out.append(None if path is None or not n else _dataset(path, args, encoder, processor, n, flag, args.seed,
                                                               tokens_per_image, split))
    return out[0], out[1], out[2]


def _split_length(path: str, split: str, flag: str) -> int:
    from megatrain.data.multimodal.energon import split_length

    return split_length(path, split, f"{flag} {path}")


def _split_has_samples(path: str, split: str, flag: str) -> bool:
    return _split_length(path, split, flag) > 0


def _note(line: str) -> None:
    if int(os.environ.get("RANK", "0") or 0) == 0:
        print(f"note: {line}", flush=True)


def _implicit_val(train: str, train_flag: str) -> tuple[str | None, str]:
    """Megatron's validation without ``--valid-data-path``: the ``val`` split of the training data, when
    it has samples (else none, with a note)."""
    if _split_has_samples(train, "val", train_flag):
        return train, train_flag  # the note comes with the dataset
    _note(f"no validation: {train_flag} {train} has no val split samples and no --valid-data-path is given")
    return None, train_flag
