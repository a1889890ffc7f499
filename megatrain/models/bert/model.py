"""BertModel: Megatron-LM's BERT (a bidirectional encoder with a masked-LM head and a sentence-order
head) as plain PyTorch.

Module paths are a contract shared with the parallelism, checkpoint and conversion code (Megatron's
names, with the encoder's layers and final norm at the top as in every megatrain family):

    embedding.{word_embeddings, position_embeddings, tokentype_embeddings}
    layers["0"...]            the shared pre-norm transformer layer, bidirectional attention
    final_layernorm
    lm_head.{dense, layer_norm}   the masked-LM transform: dense, GELU, LayerNorm
    output_layer.bias         (and output_layer.weight with --untie-embeddings-and-output-weights;
                              otherwise the word embeddings are the output weight)
    pooler.dense              dense + tanh on the [CLS] position (with the binary head)
    binary_head               [h -> 2] sentence-order logits (with the binary head)

Attention: the padding mask hides padded keys from every query (Megatron's padding mask as
Transformer Engine and Hugging Face apply it), so no row of scores is ever fully masked.

The GELU of the masked-LM transform is the MLP's (``config.gelu_approximation``): Megatron's LM head
uses exact GELU while its fused bias-GELU in the MLP is tanh-approximated; one activation keeps the
model expressible as Hugging Face's ``MegatronBertForPreTraining`` (one ``hidden_act``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.models.bert.config import BertConfig
from megatrain.models.common.embedding import Embedding
from megatrain.models.common.heads import LogitsCrossEntropy, LossHead
from megatrain.models.common.init import canonical_parameter_name, megatron_initial_value
from megatrain.models.common.norms import build_norm
from megatrain.models.common.rope import rotary_tables
from megatrain.models.common.transformer_layer import TransformerLayer

__all__ = ["BertModel", "BertLMHead", "Pooler", "OutputLayer", "initial_value", "padding_attention_mask"]


class BertLMHead(nn.Module):
    """The masked-LM transform: dense [h -> h], GELU, LayerNorm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon)
        self.gelu_approximation = config.gelu_approximation

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(F.gelu(self.dense(hidden), approximate=self.gelu_approximation))


class Pooler(nn.Module):
    """tanh(dense(hidden[:, 0])): the [CLS] position's summary of the sequence."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class OutputLayer(nn.Module):
    """The vocabulary projection: ``bias`` [V] always, ``weight`` [V, h] only when untied (the tied
    weight, the word embeddings, is passed to ``forward``)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        v, h = config.vocab_size, config.hidden_size
        self.weight = nn.Parameter(torch.empty(v, h)) if config.untie_embeddings_and_output_weights else None
        self.bias = nn.Parameter(torch.zeros(v))

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        assert weight is not None, "a tied output layer needs the word embeddings"
        return F.linear(hidden, weight, self.bias)


def padding_attention_mask(padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[b, s] (nonzero = a real token) -> bool [b, 1, 1, s] (True = may be attended to), or None."""
    if padding_mask is None:
        return None
    return (padding_mask != 0).view(padding_mask.shape[0], 1, 1, padding_mask.shape[1])


class BertModel(nn.Module):
    """BERT for pre-training.

    ``forward(tokens, padding_mask, tokentype_ids)`` returns ``(lm_logits [b, s, V],
    sop_logits [b, 2] or None)``. With ``labels`` (-100 where there is no masked-LM target) it
    returns the training losses as one float32 tensor: the per-token masked-LM loss [b, s], and with
    the binary head one more column, the per-sample sentence-order loss given ``sentence_order``
    ([b, s + 1]); one tensor so that a pipeline's last stage hands the objective one output.

    ``loss_head`` (see :mod:`megatrain.models.common.heads`) turns the masked-LM transform's
    output and the labels into the per-token loss; parallel code may put the chunked or the
    vocab-parallel head there. ``logits(x)`` projects the transform's output onto the vocabulary.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding: Embedding | None = Embedding(config, num_tokentypes=config.num_tokentypes)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, layer_number=i)
                                     for i in range(config.num_layers)})
        self.final_layernorm: nn.Module | None = build_norm(config)
        self.lm_head: BertLMHead | None = BertLMHead(config)
        self.output_layer: OutputLayer | None = OutputLayer(config)
        self.pooler: Pooler | None = Pooler(config) if config.add_binary_head else None
        self.binary_head: nn.Linear | None = nn.Linear(config.hidden_size, 2) if config.add_binary_head else None
        self.loss_head: LossHead = LogitsCrossEntropy()
        if not next(self.parameters()).is_meta:
            self.init_weights(seed=0)

    # ---- the pieces parallel code wraps -------------------------------------------------------

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor,
              tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [b, s] -> hidden states [b, s, h] (in the autocast dtype under autocast)."""
        assert self.embedding is not None
        hidden = self.embedding(tokens, position_ids, tokentype_ids)
        device_type = hidden.device.type
        if not self.config.fp32_residual_connection and torch.is_autocast_enabled(device_type):
            hidden = hidden.to(torch.get_autocast_dtype(device_type))
        return hidden

    def encode(self, hidden: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | None) -> torch.Tensor:
        rotary = rotary_tables(self.config, position_ids)  # once for all layers (None without RoPE)
        for layer in self.layers.values():
            hidden = layer(hidden, position_ids, attention_mask, rotary=rotary)
        return hidden

    def output_weight(self) -> torch.Tensor:
        """The output layer's weight [V, h]: its own, or the word embeddings' when tied."""
        assert self.output_layer is not None
        if self.output_layer.weight is not None:
            return self.output_layer.weight
        assert self.embedding is not None, "tied output weights need the word embeddings"
        return self.embedding.word_embeddings.weight

    def output_bias(self) -> torch.Tensor:
        assert self.output_layer is not None
        return self.output_layer.bias

    def logits(self, transformed: torch.Tensor) -> torch.Tensor:
        """The masked-LM transform's output [b, s, h] -> vocabulary logits [b, s, V]."""
        assert self.output_layer is not None
        tied = None if self.output_layer.weight is not None else self.output_weight()
        return self.output_layer(transformed, tied)

    def sentence_order_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.binary_head is None:
            return None
        assert self.pooler is not None
        return self.binary_head(self.pooler(hidden))

    def head(self, hidden: torch.Tensor, labels: torch.Tensor | None = None,
             sentence_order: torch.Tensor | None = None, lm_positions: torch.Tensor | None = None):
        """The last layer's hidden states -> final norm -> (logits, sentence-order logits), or with
        ``labels`` the losses (see the class docstring).

        ``lm_positions`` [b, k] (with ``labels``): the only positions whose masked-LM loss is computed
        (every position with a label among them, each once); the masked-LM head then runs on k
        positions per sample instead of s, and the loss elsewhere is 0, as it is for unlabelled
        positions anyway."""
        assert self.final_layernorm is not None and self.lm_head is not None
        hidden = self.final_layernorm(hidden)
        sop_logits = self.sentence_order_logits(hidden)
        if labels is None:
            return self.logits(self.lm_head(hidden)), sop_logits
        if lm_positions is None:
            lm_loss = self.loss_head.per_token_loss(self, self.lm_head(hidden), labels)
        else:
            picked = hidden.gather(1, lm_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
            picked_loss = self.loss_head.per_token_loss(self, self.lm_head(picked), labels.gather(1, lm_positions))
            lm_loss = picked_loss.new_zeros(labels.shape).scatter(1, lm_positions, picked_loss)
        if sop_logits is None:
            return lm_loss
        if sentence_order is None:
            raise ValueError("a BERT model with the binary head needs the sentence-order labels to give its losses")
        sop_loss = F.cross_entropy(sop_logits.float(), sentence_order, ignore_index=-1, reduction="none")
        return torch.cat([lm_loss, sop_loss.unsqueeze(1)], dim=1)

    # ---- forward ------------------------------------------------------------------------------

    def encoder_output(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None,
                       tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [b, s] -> the last layer's hidden states [b, s, h] (before the final norm)."""
        s = tokens.shape[1]
        if self.config.position_embedding_type == "learned_absolute" and s > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {s} tokens is longer than --max-position-embeddings "
                             f"({self.config.max_position_embeddings})")
        position_ids = torch.arange(s, device=tokens.device).unsqueeze(0)
        hidden = self.embed(tokens, position_ids, tokentype_ids)
        return self.encode(hidden, position_ids, padding_attention_mask(padding_mask))

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None,
                tokentype_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                sentence_order: torch.Tensor | None = None, lm_positions: torch.Tensor | None = None):
        hidden = self.encoder_output(tokens, padding_mask, tokentype_ids)
        return self.head(hidden, labels, sentence_order, lm_positions)

    # ---- parameters -----------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter with ``initial_value`` (also right after meta -> ``to_empty``)."""
        for name, param in self.named_parameters():
            param.copy_(initial_value(name, param.shape, self.config, seed))

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (a tied output weight counts once); ``exclude_embeddings`` leaves out
        the word, position and token-type embeddings and an untied output weight."""
        total = sum(p.numel() for p in self.parameters())
        if not exclude_embeddings:
            return total
        tables: list[nn.Parameter | None] = []
        if self.embedding is not None:
            tables += [m.weight if m is not None else None for m in (
                self.embedding.word_embeddings, self.embedding.position_embeddings,
                self.embedding.tokentype_embeddings)]
        if self.output_layer is not None:
            tables.append(self.output_layer.weight)
        return total - sum(t.numel() for t in tables if t is not None)


# ---- deterministic initialisation ---------------------------------------------------------------

_STD_WEIGHTS = frozenset({"linear_qkv", "linear_fc1", "word_embeddings", "position_embeddings",
                          "tokentype_embeddings", "dense", "binary_head", "output_layer"})


def initial_value(name: str, shape: Sequence[int], config: BertConfig, seed: int) -> torch.Tensor:
    """The initial value of BERT parameter ``name``: Megatron's rules (embeddings and the linear layers
    of the heads N(0, std), the residual projections N(0, std / sqrt(2 L)), biases 0, norms 1);
    ``lm_head.layer_norm`` is a plain LayerNorm (weight 1, bias 0) whatever ``--apply-layernorm-1p``."""
    parts = canonical_parameter_name(name).split(".")
    if len(parts) >= 2 and parts[-2] == "layer_norm":
        return torch.ones(tuple(shape)) if parts[-1] == "weight" else torch.zeros(tuple(shape))
    return megatron_initial_value(name, shape, config, seed, std_weights=_STD_WEIGHTS)
