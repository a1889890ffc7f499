"""Typed micro-batches, and the causal-LM batch from samples: tokens, labels, loss mask, position
ids, attention mask.

:class:`Batch` is the base of every batch kind: a dataclass of tensors (or None) that moves to a
device, concatenates micro-batches (pipeline parallelism runs an iteration's micro-batches as one),
and gives its context-parallel part (the base refuses; a kind that supports it says how).
:class:`CausalLMBatch` is GPT's (pre-training and fine-tuning); :class:`MaskedLMBatch` and
:class:`Seq2SeqBatch` are the fields of Megatron's BERT and T5 samples, for those families' objectives.

Same semantics as Megatron-LM's ``get_ltor_masks_and_position_ids``, vectorised, with one
difference of convention: our ``attention_mask`` follows SDPA (``True`` = may attend), while
Megatron's uses ``True`` = masked out. Without ``reset_attention_mask`` the mask is ``None``
and the model uses plain causal attention.

With the reset flags, an end-of-document (EOD) token belongs to the document it ends: the
token after it starts a new segment whose positions restart at 0 and which cannot attend to
earlier segments. With ``eod_mask_loss`` the loss is not computed where the *input* token is EOD.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Optional, TypeVar

import torch

__all__ = ["Batch", "CausalLMBatch", "MaskedLMBatch", "Seq2SeqBatch", "block_causal_mask", "make_batch",
           "packed_attention", "to_device", "MTP_FIELDS", "mtp_fields"]

B = TypeVar("B", bound="Batch")


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """bool [..., S, S], True = may attend: position i sees the positions j <= i of its own segment
    (``segments`` [..., S]: each position's sample number in a packed sequence)."""
    arange = torch.arange(segments.shape[-1], device=segments.device)
    causal = arange[:, None] >= arange[None, :]
    return causal & (segments[..., :, None] == segments[..., None, :])


def packed_attention(segments: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Position ids [b, S] restarting at every sample and the attention mask (bool [b, 1, S, S], True =
    may attend: causal within a sample; None when no row holds two samples) of ``segments`` [b, S], the
    sample number of each position of a packed row (fine-tuning's and the vision-language packing)."""
    b, s = segments.shape
    arange = torch.arange(s, device=segments.device)
    new_segment = torch.ones_like(segments, dtype=torch.bool)
    new_segment[:, 1:] = segments[:, 1:] != segments[:, :-1]
    starts = torch.cummax(torch.where(new_segment, arange, torch.zeros_like(arange)), dim=1).values
    position_ids = arange - starts
    attention_mask = None
    if bool((segments.max(dim=1).values > 1).any()):
        attention_mask = block_causal_mask(segments).unsqueeze(1)
    return position_ids, attention_mask


@dataclass
class Batch:
    """A micro-batch: tensor fields (dim 0 is the batch), or None."""

    # Fields whose dim 1 is the sequence: context parallelism keeps this rank's positions of them.
    sequence_fields: ClassVar[tuple[str, ...]] = ()

    def _map_tensors(self: B, fn: Any) -> B:
        return replace(self, **{f.name: fn(v) for f in fields(self)
                                if isinstance(v := getattr(self, f.name), torch.Tensor)})

    def to(self: B, device: torch.device, non_blocking: bool = False) -> B:
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self: B) -> B:
        """The batch with its tensors in page-locked memory: a DataLoader with ``pin_memory=True`` calls
        this for a type it does not know (without it the batch would stay in pageable memory, whose
        copies to the device the host stages itself)."""
        return self._map_tensors(torch.Tensor.pin_memory)

    @classmethod
    def cat(cls: type[B], batches: list[B]) -> B:
        """The micro-batches as one batch (dim 0); a field None in the first is None in the result."""
        values = {}
        for f in fields(cls):
            first = getattr(batches[0], f.name)
            values[f.name] = None if first is None else torch.cat([getattr(b, f.name) for b in batches])
        return cls(**values)

    def context_parallel_part(self: B, index: torch.Tensor) -> B:
        """This context-parallel rank's part: the sequence positions ``index`` of every sequence field."""
        raise ValueError(f"--context-parallel-size > 1 does not support {type(self).__name__} batches")

    @property
    def seq_length(self) -> int:
        return int(getattr(self, self.sequence_fields[0]).shape[1])


@dataclass
class CausalLMBatch(Batch):
    """Next-token prediction: tokens/labels [b, s], loss_mask float [b, s], position_ids int64 [b, s],
    attention_mask None (causal) or bool [b, 1, s, s] (True = may attend). With multi-token prediction
    (``--mtp-num-layers``) the :func:`mtp_fields` too, else None."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: Optional[torch.Tensor] = None
    attention_mask: Optional[torch.Tensor] = None
    mtp_tokens: Optional[torch.Tensor] = None  # int64 [b, s, D]
    mtp_labels: Optional[torch.Tensor] = None  # int64 [b, s, D]
    mtp_loss_mask: Optional[torch.Tensor] = None  # float [b, s, D]
    mtp_counts: Optional[torch.Tensor] = None  # float [b, D + 1]

    sequence_fields: ClassVar[tuple[str, ...]] = ("tokens", "labels", "loss_mask", "position_ids")

    def mtp_targets(self) -> dict[str, torch.Tensor]:
        """The multi-token prediction fields by name ({} without them)."""
        return {name: getattr(self, name) for name in MTP_FIELDS if getattr(self, name) is not None}

    @classmethod
    def cat(cls, batches: list["CausalLMBatch"]) -> "CausalLMBatch":
        """As :meth:`Batch.cat`; when only some micro-batches have an attention mask (fine-tuning: rows
        packing several examples), the others get their causal one, so that no mask is lost."""
        masked = [b.attention_mask is not None for b in batches]
        if any(masked) and not all(masked):
            batches = [b if b.attention_mask is not None else replace(b, attention_mask=_causal_mask(b.tokens))
                       for b in batches]
        return super().cat(batches)

    def context_parallel_part(self, index: torch.Tensor) -> "CausalLMBatch":
        if self.attention_mask is not None:
            raise ValueError("--context-parallel-size > 1 does not support explicit attention masks "
                             "(--reset-attention-mask)")
        positions = self.position_ids
        if positions is None:
            positions = torch.arange(self.tokens.shape[1], device=self.tokens.device).unsqueeze(0)
        shifted = {name: getattr(self, name).index_select(1, index) for name in MTP_FIELDS[:3]
                   if getattr(self, name) is not None}  # computed from the whole sequence; mtp_counts too
        return replace(self, tokens=self.tokens.index_select(1, index), labels=self.labels.index_select(1, index),
                       loss_mask=self.loss_mask.index_select(1, index), position_ids=positions.index_select(1, index),
                       **shifted)


@dataclass
class MaskedLMBatch(Batch):
    """Masked-language-model batches (Megatron's BERT samples): tokens with masked positions replaced,
    tokentype ids, the original tokens as labels where the loss mask is set, the padding mask
    (True = a real token), and the sentence-order label of each sample (-1 without that head).
    ``images`` has room for a vision encoder's input ([b, c, h, w]), None for text."""

    tokens: torch.Tensor  # int64 [b, s]
    tokentype_ids: torch.Tensor  # int64 [b, s]
    labels: torch.Tensor  # int64 [b, s]
    loss_mask: torch.Tensor  # float [b, s]
    padding_mask: torch.Tensor  # bool [b, s]
    sentence_order: Optional[torch.Tensor] = None  # int64 [b]
    # int64 [b, k]: k positions per sample holding every labelled one (the masked-LM head runs there only)
    lm_positions: Optional[torch.Tensor] = None
    images: Optional[torch.Tensor] = None

    sequence_fields: ClassVar[tuple[str, ...]] = ("tokens", "tokentype_ids", "labels", "loss_mask", "padding_mask")


@dataclass
class Seq2SeqBatch(Batch):
    """Encoder-decoder batches (Megatron's T5 samples): encoder tokens and their padding mask, decoder
    input tokens, labels and loss mask, and the decoder's padding mask. ``images`` has room for a
    vision encoder's input, None for text."""

    encoder_tokens: torch.Tensor  # int64 [b, s_enc]
    encoder_padding_mask: torch.Tensor  # bool [b, s_enc]
    decoder_tokens: torch.Tensor  # int64 [b, s_dec]
    labels: torch.Tensor  # int64 [b, s_dec]
    loss_mask: torch.Tensor  # float [b, s_dec]
    decoder_padding_mask: torch.Tensor  # bool [b, s_dec]
    images: Optional[torch.Tensor] = None

    sequence_fields: ClassVar[tuple[str, ...]] = ("decoder_tokens", "labels", "loss_mask", "decoder_padding_mask")


def to_device(samples: Any, device: torch.device) -> Any:
    """The loader's collated samples (a tensor, or a dict of tensors) on ``device`` (non-blocking)."""
    if isinstance(samples, dict):
        return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in samples.items()}
    return samples.to(device, non_blocking=True)


def _causal_mask(tokens: torch.Tensor) -> torch.Tensor:
    """The plain causal attention mask of ``tokens`` [b, s]: bool [b, 1, s, s] (True = may attend)."""
    b, s = tokens.shape
    arange = torch.arange(s, device=tokens.device)
    return (arange[:, None] >= arange[None, :]).expand(b, 1, s, s)


def _segment_starts(is_eod: torch.Tensor) -> torch.Tensor:
    """For each position, the index just after the last EOD strictly before it (0 if none)."""
    b, s = is_eod.shape
    after = torch.arange(1, s + 1, device=is_eod.device).expand(b, s)
    marks = torch.where(is_eod, after, torch.zeros_like(after))
    starts = torch.zeros_like(marks)
    if s > 1:
        starts[:, 1:] = torch.cummax(marks[:, :-1], dim=1).values
    return starts


MTP_FIELDS = ("mtp_tokens", "mtp_labels", "mtp_loss_mask", "mtp_counts")


def _shift_left(values: torch.Tensor, steps: int) -> torch.Tensor:
    """``values`` [b, s] moved ``steps`` positions left along the sequence, the last ``steps`` set to 0."""
    out = torch.zeros_like(values)
    if steps < values.shape[1]:
        out[:, : values.shape[1] - steps] = values[:, steps:]
    return out


def mtp_fields(tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
               depths: int) -> dict[str, torch.Tensor]:
    """Multi-token prediction's batch fields for ``depths`` depths from [b, s] tokens, labels and loss mask
    (Megatron's ``roll_tensor``, once per depth): ``mtp_tokens``, ``mtp_labels`` and ``mtp_loss_mask``
    [b, s, depths], column k shifted left by k + 1 with the vacated positions 0; ``mtp_counts`` float
    [b, depths + 1], each sample's loss tokens (unshifted, then per depth). Computed from the whole
    sequence, so a context-parallel rank's part (:meth:`CausalLMBatch.context_parallel_part`) keeps the
    tokens from beyond its own positions and the counts of the whole sequence."""
    shifted = {"mtp_tokens": tokens, "mtp_labels": labels, "mtp_loss_mask": loss_mask}
    out = {name: torch.stack([_shift_left(v, k + 1) for k in range(depths)], dim=-1) for name, v in shifted.items()}
    out["mtp_counts"] = torch.cat([loss_mask.float().sum(dim=1, keepdim=True),
                                   out["mtp_loss_mask"].float().sum(dim=1)], dim=1)
    return out


def make_batch(samples: torch.Tensor, eod_token: Optional[int], reset_position_ids: bool = False,
               reset_attention_mask: bool = False, eod_mask_loss: bool = False, mtp_depths: int = 0) -> CausalLMBatch:
    """``samples`` int64 [b, s+1] -> tokens/labels [b, s], loss_mask float [b, s], position_ids
    int64 [b, s], attention_mask ``None`` or bool [b, 1, s, s] (True = may attend); with ``mtp_depths``
    the :func:`mtp_fields` of that many multi-token prediction depths."""
    if samples.dim() != 2 or samples.shape[1] < 2:
        raise ValueError(f"samples must be [batch, seq_length+1], got shape {tuple(samples.shape)}")
    samples = samples.long()
    tokens = samples[:, :-1].contiguous()
    labels = samples[:, 1:].contiguous()
    b, s = tokens.shape
    device = tokens.device
    needs_eod = reset_position_ids or reset_attention_mask or eod_mask_loss
    if needs_eod and eod_token is None:
        raise ValueError("--reset-position-ids/--reset-attention-mask/--eod-mask-loss need an EOD token")
    is_eod = tokens == eod_token if needs_eod else None

    loss_mask = torch.ones((b, s), dtype=torch.float, device=device)
    if eod_mask_loss:
        loss_mask.masked_fill_(is_eod, 0.0)  # no host sync (boolean indexing would need one)

    arange = torch.arange(s, dtype=torch.long, device=device)
    starts = _segment_starts(is_eod) if (reset_position_ids or reset_attention_mask) else None
    if reset_position_ids:
        position_ids = arange.unsqueeze(0) - starts
    else:
        position_ids = arange.unsqueeze(0).expand(b, s).contiguous()

    attention_mask = None
    if reset_attention_mask:  # a segment is known by its start
        attention_mask = block_causal_mask(starts).unsqueeze(1)
    extra = mtp_fields(tokens, labels, loss_mask, mtp_depths) if mtp_depths else {}
    return CausalLMBatch(tokens, labels, loss_mask, position_ids, attention_mask, **extra)
