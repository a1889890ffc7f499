"""T5's relative position bias (``--position-embedding-type relative``): one learned scalar per
attention head and distance bucket, added to the attention scores.

The distance from a query at position i to a key at position j is ``j - i``. Small distances get
a bucket each; larger ones share logarithmically wider buckets up to ``max_distance``, beyond
which all fall into the last bucket. Bidirectional attention (an encoder) spends half of the
buckets on keys after the query; unidirectional attention (a causal decoder) only looks back and
uses all buckets for ``i - j >= 0``. The rule is T5's (Megatron-core's
``RelativePositionEmbedding``, Hugging Face's ``T5Attention``), so the bias table maps one to one.

A model computes the bias once per forward for each stack of layers and adds it to every layer's
self-attention scores (never to cross-attention). The table ``relative_attention_bias.weight``
is [buckets, heads]: its columns are the heads, so a tensor-parallel plan shards it on dim 1 and
each rank computes the bias of its own heads.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["RelativePositionBias", "relative_position_bucket"]


def relative_position_bucket(relative_position: torch.Tensor, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """Bucket ids (int64, the shape of ``relative_position``, in [0, num_buckets)) of key minus
    query positions."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets  # keys after the query
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # keys after the query count as distance 0
    exact = num_buckets // 2  # distances below this get a bucket each
    # The rest: log-spaced from `exact` to max_distance (distance clamped to 1 where it is unused).
    log_ratio = torch.log(distance.clamp(min=1).float() / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """``forward(query_length, key_length, device)`` -> the bias [1, heads, query_length, key_length]
    (float32, the table's dtype), for keys and queries at positions 0, 1, ..."""

    def __init__(self, num_heads: int, *, num_buckets: int, max_distance: int, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)

    def forward(self, query_length: int, key_length: int, device: torch.device) -> torch.Tensor:
        query = torch.arange(query_length, device=device)[:, None]
        key = torch.arange(key_length, device=device)[None, :]
        buckets = relative_position_bucket(key - query, bidirectional=self.bidirectional,
                                           num_buckets=self.num_buckets, max_distance=self.max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)  # [1, heads, q, k]

    def distance_bias(self, query_length: int, key_length: int, device: torch.device, *,
                      pad_to: int = 1) -> tuple[torch.Tensor, int]:
        """The bias of every key-minus-query distance, for attention kernels that add it themselves
        (FlexAttention's ``score_mod``): (bias [heads, L] (float32, the table's dtype), offset), the
        bias of query i and key j at column ``j - i + offset``. Nothing of size query x key: one
        bucket lookup per distance, from -(Q - 1) to K - 1 with Q and K the lengths rounded up to
        ``pad_to`` (a kernel working in tiles may read positions past the ends)."""
        q_pad = -(-query_length // pad_to) * pad_to
        k_pad = -(-key_length // pad_to) * pad_to
        distance = torch.arange(-(q_pad - 1), k_pad, device=device)
        buckets = relative_position_bucket(distance, bidirectional=self.bidirectional, num_buckets=self.num_buckets,
                                           max_distance=self.max_distance)
        return self.relative_attention_bias(buckets).t().contiguous(), q_pad - 1  # [heads, L]

    def extra_repr(self) -> str:
        return f"buckets={self.num_buckets}, max_distance={self.max_distance}, bidirectional={self.bidirectional}"
