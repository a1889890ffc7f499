"""The toy encoder: shared embedding and transformer layers (bidirectional), a final norm, and two
classification heads: the class from the first position's hidden state, the parity from the last's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel

from megatrain.models.common.config import TransformerConfig
from megatrain.models.common.embedding import Embedding
from megatrain.models.common.init import megatron_initial_value
from megatrain.models.common.norms import build_norm
from megatrain.models.common.tp_plan import TensorParallelPlan, layers_plan, vocab_parallel_embedding_plan
from megatrain.models.common.transformer_layer import TransformerLayer


@dataclass
class ToyEncoderConfig(TransformerConfig):
    num_classes: int = 4
    causal_attention: ClassVar[bool] = False  # an encoder: every position sees the whole sequence


def toy_config_from_args(args, vocab_size: int) -> ToyEncoderConfig:
    return ToyEncoderConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                            num_attention_heads=args.num_attention_heads, vocab_size=vocab_size,
                            max_position_embeddings=args.max_position_embeddings,
                            hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                            init_method_std=args.init_method_std)


class ToyEncoder(nn.Module):
    """forward(tokens [b, s], labels [b, 2] or None) -> per-sample losses [b, 2] (class, parity), or
    the two heads' logits."""

    def __init__(self, config: ToyEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding: nn.Module | None = Embedding(config)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, i) for i in range(config.num_layers)})
        self.final_layernorm: nn.Module | None = build_norm(config)
        self.classifier: nn.Module | None = nn.Linear(config.hidden_size, config.num_classes)
        self.parity: nn.Module | None = nn.Linear(config.hidden_size, 2)

    def trunk(self, x: torch.Tensor, first: bool) -> torch.Tensor:
        if first:
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            x = self.embedding(x, positions)
        for layer in self.layers.values():
            x = layer(x)
        return x

    def heads(self, hidden: torch.Tensor, labels: torch.Tensor | None):
        hidden = self.final_layernorm(hidden)
        cls, parity = self.classifier(hidden[:, 0]), self.parity(hidden[:, -1])
        if labels is None:
            return cls, parity
        return torch.stack([F.cross_entropy(cls.float(), labels[:, 0], reduction="none"),
                            F.cross_entropy(parity.float(), labels[:, 1], reduction="none")], dim=1)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None):
        return self.heads(self.trunk(tokens, True), labels)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.embedding is not None:
            total -= sum(p.numel() for p in self.embedding.parameters())
        return total


class ToyStage(ToyEncoder):
    """One pipeline stage: the layers ``layer_ids``; the embedding on the first, the heads on the last."""

    def __init__(self, config: ToyEncoderConfig, layer_ids: Sequence[int], *, stage_index: int,
                 num_stages: int) -> None:
        super().__init__(config)
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        for key in [k for k in self.layers.keys() if int(k) not in layer_ids]:
            del self.layers[key]
        if not self.is_first:
            self.embedding = None
        if not self.is_last:
            self.final_layernorm = self.classifier = self.parity = None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):  # type: ignore[override]
        hidden = self.trunk(x, self.is_first)
        return self.heads(hidden, labels) if self.is_last else hidden


_STD = frozenset({"linear_qkv", "linear_fc1", "word_embeddings", "position_embeddings", "classifier", "parity"})


def initial_value(name: str, shape, config: ToyEncoderConfig, seed: int) -> torch.Tensor:
    return megatron_initial_value(name, shape, config, seed, std_weights=_STD)


def tensor_parallel_plan(model: ToyEncoder, *, sequence_parallel: bool) -> TensorParallelPlan:
    """The shared layers' plan; the heads stay replicated (the final norm hands them the whole
    sequence as a plain tensor)."""
    plan = layers_plan(model.layers, model.config, sequence_parallel)
    if model.embedding is not None:
        plan.styles[:0] = vocab_parallel_embedding_plan("embedding", sequence_parallel)
    if model.final_layernorm is not None and sequence_parallel:
        plan.styles += [("final_layernorm", SequenceParallel()),
                        ("final_layernorm", PrepareModuleOutput(output_layouts=Shard(1),
                                                                desired_output_layouts=Replicate(),
                                                                use_local_output=True))]
    return plan


def toy_flops(cfg: ToyEncoderConfig, batch_size: int, seq_length: int) -> float:
    h, L = cfg.hidden_size, cfg.num_layers
    per_token = 6 * L * (4 * h * h + 2 * h * cfg.ffn_hidden_size)
    return float(batch_size * seq_length * per_token + 12 * batch_size * seq_length ** 2 * L * h)
