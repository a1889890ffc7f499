"""Data-parallel micro-batches of every global batch, resumable from consumed samples.

Megatron's ``MegatronPretrainingSampler``: the samples ``consumed, consumed+1, ...`` are cut
into blocks of ``micro_batch_size * data_parallel_size``; data-parallel rank ``r`` takes the
contiguous slice ``[r*mbs, (r+1)*mbs)`` of each block. So a global batch is the same set of
samples whatever the layout, and resuming from ``consumed_samples`` continues exactly where a
run stopped without replaying data. An incomplete last block is dropped.

With ``--dataloader-type cyclic`` (Megatron's ``MegatronPretrainingRandomSampler``),
:class:`RandomPretrainingSampler` goes over the dataset epoch after epoch, each in the order of
``torch.randperm`` seeded by the epoch number: with data sharding (the default;
``--no-data-sharding`` turns it off) data-parallel rank ``r`` draws from its own contiguous bucket
of the dataset, without it the ranks take turns through one permutation of all samples. The
position is again the consumed-sample count, so a resumed run continues the same permutation.

`build_pretraining_data_loader` returns a torch ``DataLoader`` (background workers when
``num_workers > 0``, persistent between passes) yielding int64 tensors
``[micro_batch_size, seq_length + 1]``. `build_eval_data_loader` is the validation variant:
with ``cyclic=True`` it starts over (from the same ``consumed_samples``, as Megatron's
``cyclic_iter`` does) when exhausted.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

__all__ = ["PretrainingSampler", "RandomPretrainingSampler", "build_pretraining_data_loader",
           "build_eval_data_loader", "collate_samples"]


class PretrainingSampler:
    """Batch sampler yielding this rank's micro-batch indices (Megatron's sampler semantics)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"no samples to draw from (dataset has {total_samples})")
        if consumed_samples < 0:
            raise ValueError(f"consumed samples must be >= 0, got {consumed_samples}")
        if consumed_samples >= total_samples:
            raise ValueError(f"no samples left: {consumed_samples} consumed of {total_samples}; "
                             "the run needs more data (raise the sample count or lower --train-iters)")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError("micro batch size and data-parallel size must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data-parallel rank {data_parallel_rank} not in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.block = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        full, rest = divmod(self.total_samples - self.consumed_samples, self.block)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        lo = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + self.block <= self.total_samples:
            yield list(range(start + lo, start + lo + self.micro_batch_size))
            start += self.block
        if not self.drop_last and start < self.total_samples:
            rest = list(range(start, self.total_samples))
            yield rest[lo:lo + self.micro_batch_size]


class RandomPretrainingSampler:
    """Endless batch sampler of this rank's micro-batches in per-epoch random order (``cyclic``)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_sharding: bool = True):
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError("micro batch size and data-parallel size must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data-parallel rank {data_parallel_rank} not in [0, {data_parallel_size})")
        self.block = micro_batch_size * data_parallel_size
        if total_samples < self.block:
            raise ValueError(f"--dataloader-type cyclic needs at least one global micro-batch of samples "
                             f"({self.block}); the dataset has {total_samples}")
        if consumed_samples < 0 or consumed_samples % self.block:
            raise ValueError(f"consumed samples ({consumed_samples}) must be a non-negative multiple of "
                             f"micro-batch x data-parallel size ({self.block})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank, self.size = data_parallel_rank, data_parallel_size
        self.data_sharding = data_sharding
        self.active = total_samples - total_samples % self.block  # the incomplete last block is left out

    def _epoch_order(self, epoch: int, offset: int) -> list[int]:
        """This rank's sample indices for the rest of ``epoch`` after ``offset`` consumed samples."""
        g = torch.Generator()
        g.manual_seed(epoch)
        if self.data_sharding:
            bucket = (self.total_samples // self.block) * self.micro_batch_size
            first = self.rank * bucket
            return [first + i for i in torch.randperm(bucket, generator=g)[offset // self.size:].tolist()]
        whole = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
        return torch.randperm(whole, generator=g)[offset:].tolist()[self.rank::self.size]

    def __iter__(self) -> Iterator[list[int]]:
        consumed = self.consumed_samples
        while True:
            epoch, offset = divmod(consumed, self.active)
            order = self._epoch_order(epoch, offset)
            for start in range(0, len(order) - self.micro_batch_size + 1, self.micro_batch_size):
                consumed += self.block
                yield order[start:start + self.micro_batch_size]


def collate_samples(samples: list) -> Any:
    """Stack samples into a micro-batch: numpy int arrays into one int64 tensor [batch, seq_length + 1];
    dict samples (several arrays per sample) field by field into a dict of such tensors."""
    if isinstance(samples[0], dict):
        return {key: torch.from_numpy(np.stack([np.asarray(s[key], dtype=np.int64) for s in samples]))
                for key in samples[0]}
    return torch.from_numpy(np.stack([np.asarray(s, dtype=np.int64) for s in samples]))


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  num_workers: int, pin_memory: bool = False, dataloader_type: str = "single",
                                  data_sharding: bool = True) -> Optional[DataLoader]:
    """DataLoader over this rank's micro-batches from ``consumed_samples`` on (None for no dataset).

    ``dataloader_type``: ``single`` (the dataset's order, once) or ``cyclic`` (random order per
    epoch, endless; ``data_sharding`` as Megatron's ``--no-data-sharding`` leaves it). A dataset with
    a ``collate_fn`` attribute collates its own samples (the vision-language datasets' typed batches);
    others go through :func:`collate_samples`.
    """
    if dataset is None:
        return None
    sampler: PretrainingSampler | RandomPretrainingSampler
    if dataloader_type == "cyclic":
        sampler = RandomPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                           data_parallel_rank, data_parallel_size, data_sharding)
    elif dataloader_type == "single":
        sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                     data_parallel_rank, data_parallel_size)
    else:
        raise ValueError(f"--dataloader-type must be single or cyclic, got {dataloader_type!r}")
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory, collate_fn=getattr(dataset, "collate_fn", None) or collate_samples,
                      persistent_workers=num_workers > 0)


class _Cyclic:
    """Iterable that restarts the loader whenever it is exhausted."""

    def __init__(self, loader: DataLoader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        while True:
            yielded = False
            for batch in self.loader:
                yielded = True
                yield batch
            if not yielded:
                return


def build_eval_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                           data_parallel_rank: int, data_parallel_size: int, num_workers: int,
                           pin_memory: bool = False, cyclic: bool = True):
    """Validation/test loader; with ``cyclic`` it starts over from ``consumed_samples`` when exhausted."""
    loader = build_pretraining_data_loader(dataset, consumed_samples, micro_batch_size,
                                           data_parallel_rank, data_parallel_size, num_workers,
                                           pin_memory)
    if loader is None or not cyclic:
        return loader
    return _Cyclic(loader)
