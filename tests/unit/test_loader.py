"""Data-parallel sampling: resumption, layout independence, workers, cyclic evaluation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from megatrain.data.loader import PretrainingSampler, build_eval_data_loader, build_pretraining_data_loader


class Numbered:
    """Sample i is [i, i, i]: easy to read back which sample a batch holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(3, i, dtype=np.int64)


def ids(batch):
    return batch[:, 0].tolist()


def test_resume_gives_the_same_next_batch():
    ds = Numbered(100)
    full = list(build_pretraining_data_loader(ds, 0, 4, 1, 2, 0))
    for k in (0, 8, 24, 56):
        resumed = list(build_pretraining_data_loader(ds, k, 4, 1, 2, 0))
        assert torch.equal(resumed[0], full[k // 8])
        assert len(resumed) == len(full) - k // 8


def test_dp_ranks_cover_the_global_batch_of_dp1():
    ds = Numbered(64)
    mbs, dp = 2, 2
    dp1 = [ids(b) for b in build_pretraining_data_loader(ds, 0, mbs * dp, 0, 1, 0)]
    ranks = [[ids(b) for b in build_pretraining_data_loader(ds, 0, mbs, r, dp, 0)] for r in range(dp)]
    for step, global_batch in enumerate(dp1):
        assert ranks[0][step] + ranks[1][step] == global_batch
    # rank r takes its own contiguous slice of each block
    assert ranks[1][0] == [2, 3]


def test_drop_last_and_workers():
    ds = Numbered(23)
    batches = list(build_pretraining_data_loader(ds, 0, 5, 0, 1, 2))
    assert [ids(b) for b in batches] == [list(range(i, i + 5)) for i in range(0, 20, 5)]
    assert batches[0].dtype == torch.int64 and batches[0].shape == (5, 3)
    with pytest.raises(ValueError, match="no samples left"):
        PretrainingSampler(23, 23, 1, 0, 1)


def test_eval_loader_cycles_from_its_start():
    ds = Numbered(10)
    it = iter(build_eval_data_loader(ds, 4, 2, 0, 1, 0))
    got = [ids(b) for b in itertools.islice(it, 5)]
    assert got == [[4, 5], [6, 7], [8, 9], [4, 5], [6, 7]]
    assert len(list(build_eval_data_loader(ds, 0, 2, 0, 1, 0, cyclic=False))) == 5
    assert build_pretraining_data_loader(None, 0, 1, 0, 1, 0) is None


# ---- --dataloader-type cyclic --------------------------------------------------------------------

def _draw(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("sharding", [True, False])
def test_cyclic_sampler_covers_each_epoch_in_a_fresh_order_and_resumes(sharding):
    from megatrain.data.loader import RandomPretrainingSampler

    total, mbs, dp = 26, 2, 3  # 24 samples per epoch (the last incomplete block of 2 is left out)
    per_epoch = 24 // (mbs * dp)  # micro-batches per rank per epoch
    ranks = [RandomPretrainingSampler(total, 0, mbs, r, dp, sharding) for r in range(dp)]
    draws = [_draw(s, 3 * per_epoch) for s in ranks]
    for epoch in range(3):
        seen = [i for d in draws for b in d[epoch * per_epoch:(epoch + 1) * per_epoch] for i in b]
        assert len(seen) == len(set(seen)) == 24 and all(0 <= i < total for i in seen)
    assert draws[0][:per_epoch] != draws[0][per_epoch:2 * per_epoch]  # a new order each epoch
    if sharding:  # each rank draws from its own bucket of 8 samples
        assert {i for b in draws[1] for i in b} == set(range(8, 16))
    # Epoch 0 is torch.randperm seeded with 0, as Megatron's sampler draws it.
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(8 if sharding else 26, generator=g).tolist()
    expected = perm[:mbs] if sharding else perm[0::dp][:mbs]
    assert draws[0][0] == expected
    # Resuming from consumed samples (mid-epoch and after an epoch) continues the same sequence.
    for k in (2, per_epoch, per_epoch + 1):
        resumed = RandomPretrainingSampler(total, k * mbs * dp, mbs, 1, dp, sharding)
        assert _draw(resumed, 5) == draws[1][k:k + 5]


def test_cyclic_sampler_checks():
    from megatrain.data.loader import RandomPretrainingSampler, build_pretraining_data_loader

    with pytest.raises(ValueError, match="at least one global micro-batch"):
        RandomPretrainingSampler(3, 0, 2, 0, 2)
    with pytest.raises(ValueError, match="multiple of micro-batch"):
        RandomPretrainingSampler(40, 3, 2, 0, 2)
    with pytest.raises(ValueError, match="--dataloader-type"):
        build_pretraining_data_loader(list(range(10)), 0, 2, 0, 1, 0, dataloader_type="external")
