"""A megatron-energon dataset folder as a map-style dataset for megatrain's loader
(``pretrain_vlm.py --data-path DIR``).

energon gives a stream (its seeded shard order and shuffle buffer, endless over epochs); megatrain's
loader asks for sample indices, each data-parallel rank its own, in increasing order. Sample ``i`` is
the ``i``-th sample of the stream of seed ``seed``: reading index ``i`` reads the stream up to it (an
index lower than the last one read starts the stream again), so every rank reads the same stream and
keeps its own indices, and a resume from ``consumed`` samples reads past them again. That makes the
order and the resume exact and independent of the number of ranks, at the cost of each rank (and
loader worker) decoding the samples it passes over: fine for modest datasets and tests; energon's own
savable loader (``megatrain.data.multimodal.energon.get_train_dataset``) shards instead.

``split="train"`` reads energon's training stream (``get_train_dataset``: shard shuffling, a shuffle
buffer, endless); ``split="val"`` (or ``"test"``) reads that split as energon's ``get_val_dataset`` gives
it, Megatron's validation data: no shuffling, the split's samples in their stored order, read again from
its start after its last one (Megatron's ``RepeatDataset``), so sample ``i`` is the split's sample
``i mod N``. ``path`` is a dataset folder or a metadataset ``.yaml`` (its ``splits``' datasets, each
checked for its sample type when the dataset is built).

A sample energon cannot read, or that the encoder refuses, stops the run with one line naming the
energon sample (energon's default, logging and skipping it, is switched off). A dataset whose
``dataset.yaml`` declares a sample type megatrain does not read
(:data:`megatrain.data.multimodal.energon.READ_SAMPLE_TYPES`) stops when it is built, with one line
naming the type and the folder. Samples have one or several images (``SimilarityInterleavedSample``,
a ``VQASample`` with a list of images), as the task encoder makes them.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import torch

from megatrain.data.multimodal.conversation import ConversationEncoder
from megatrain.data.multimodal.errors import MultimodalDataError
from megatrain.data.multimodal.image_processing import CLIPImageProcessor

__all__ = ["EnergonSamples"]


def _reraise(exception: Exception, *_: Any) -> None:
    raise exception


class EnergonSamples(torch.utils.data.Dataset):
    """``num_samples`` samples of the energon dataset at ``path`` (module docstring)."""

    def __init__(self, path: str, encoder: ConversationEncoder, processor: CLIPImageProcessor, *,
                 num_samples: int, seed: int = 1234, flag: str = "--data-path",
                 shuffle_buffer_size: int | None = 100, split: str = "train"):
        from megatrain.data.multimodal import energon as mm_energon

        if not mm_energon.energon_available():
            raise MultimodalDataError("an energon dataset needs megatron-energon: pip install 'megatrain[multimodal]'",
                                      f"{flag} {path}")
        self.path, self.flag, self.seed, self.split = os.fspath(path), flag, int(seed), split
        if mm_energon.check_energon_path(self.path, f"{flag} {self.path}", split) is None:
            raise MultimodalDataError(f"the energon metadataset has no {split} split (its splits: name one "
                                      f"{split}: {{datasets: [...]}})", f"{flag} {self.path}")
        self.num_samples = int(num_samples)
        self.shuffle_buffer_size = shuffle_buffer_size
        self.task_encoder = mm_energon.LlavaTaskEncoder(encoder, processor)
        self._stream: Iterator[Any] | None = None
        self._next = 0  # index of the stream's next sample
        self._restarted_at = -1  # a finite split restarted at this index (twice at one: it is empty)

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict[str, Any]:
        # a loader worker starts its own stream
        return {**self.__dict__, "_stream": None, "_next": 0, "_restarted_at": -1}

    def _start(self) -> Iterator[Any]:
        import megatron.energon as energon

        from megatrain.data.multimodal import energon as mm_energon

        config = energon.WorkerConfig(rank=0, world_size=1, num_workers=0, seed_offset=self.seed,
                                      global_error_handler=_reraise)
        try:
            if self.split == "train":
                ds = mm_energon.get_train_dataset(self.path, self.task_encoder, worker_config=config,
                                                  shuffle_buffer_size=self.shuffle_buffer_size,
                                                  max_samples_per_sequence=self.shuffle_buffer_size)
            else:
                ds = mm_energon.get_val_dataset(self.path, self.task_encoder, split=self.split, worker_config=config)
        except MultimodalDataError:
            raise
        except mm_energon._empty_dataset_error():
            raise MultimodalDataError(f"the energon dataset's {self.split} split has no samples",
                                      f"{self.flag} {self.path}") from None
        except (OSError, ValueError, KeyError, AssertionError) as e:
            raise MultimodalDataError(f"cannot open the energon dataset ({type(e).__name__}: {e})",
                                      f"{self.flag} {self.path}") from None
        return iter(energon.get_loader(ds, watchdog_timeout_seconds=None))  # the dataset carries its worker config

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        # energon's stream draws from torch's global generator as it reads; a resume reads past the consumed
        # samples again, so reading leaves the generator as it found it (dropout then resumes exactly)
        with torch.random.fork_rng(devices=[]):
            return self._read(index)

    def _read(self, index: int) -> dict[str, Any]:
        if self._stream is None or index < self._next:
            self._stream, self._next, self._restarted_at = self._start(), 0, -1
        sample = None
        while self._next <= index:
            try:
                sample = next(self._stream)
            except StopIteration:
                if self.split == "train" or self._restarted_at == self._next:
                    raise MultimodalDataError(f"the energon stream ended (no {self.split} samples?)",
                                              f"{self.flag} {self.path}") from None
                # a validation split read to its end: again from its start (Megatron's RepeatDataset)
                self._stream, self._restarted_at = self._start(), self._next
                continue
            self._next += 1
        assert sample is not None
        return {k: v for k, v in sample.items() if not k.startswith("__")}
