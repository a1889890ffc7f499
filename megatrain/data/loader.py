"""Data-parallel micro-batches of every global batch, resumable from consumed samples.

Megatron's ``MegatronPretrainingSampler``: the samples ``consumed, consumed+1, ...`` are cut
into blocks of ``micro_batch_size * data_parallel_size``; data-parallel rank ``r`` takes the
contiguous slice ``[r*mbs, (r+1)*mbs)`` of each block. So a global batch is the same set of
samples whatever the layout, and resuming from ``consumed_samples`` continues exactly where a
run stopped without replaying data. An incomplete last block is dropped.

`build_pretraining_data_loader` returns a torch ``DataLoader`` (background workers when
``num_workers > 0``, persistent between passes) yielding int64 tensors
``[micro_batch_size, seq_length + 1]``. `build_eval_data_loader` is the validation variant:
with ``cyclic=True`` it starts over (from the same ``consumed_samples``, as Megatron's
``cyclic_iter`` does) when exhausted.
"""

from __future__ import annotations

from typing import Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

__all__ = ["PretrainingSampler", "build_pretraining_data_loader", "build_eval_data_loader",
           "collate_samples"]


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


def collate_samples(samples: list) -> torch.Tensor:
    """Stack numpy int arrays into one int64 tensor [batch, seq_length + 1]."""
    return torch.from_numpy(np.stack([np.asarray(s, dtype=np.int64) for s in samples]))


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  num_workers: int, pin_memory: bool = False) -> Optional[DataLoader]:
    """DataLoader over this rank's micro-batches from ``consumed_samples`` on (None for no dataset)."""
    if dataset is None:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                 data_parallel_rank, data_parallel_size)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory, collate_fn=collate_samples,
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
