"""Model inputs from samples: tokens, labels, loss mask, position ids, attention mask.

Same semantics as Megatron-LM's ``get_ltor_masks_and_position_ids``, vectorised, with one
difference of convention: our ``attention_mask`` follows SDPA (``True`` = may attend), while
Megatron's uses ``True`` = masked out. Without ``reset_attention_mask`` the mask is ``None``
and the model uses plain causal attention.

With the reset flags, an end-of-document (EOD) token belongs to the document it ends: the
token after it starts a new segment whose positions restart at 0 and which cannot attend to
earlier segments. With ``eod_mask_loss`` the loss is not computed where the *input* token is EOD.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["make_batch"]


def _segment_starts(is_eod: torch.Tensor) -> torch.Tensor:
    """For each position, the index just after the last EOD strictly before it (0 if none)."""
    b, s = is_eod.shape
    after = torch.arange(1, s + 1, device=is_eod.device).expand(b, s)
    marks = torch.where(is_eod, after, torch.zeros_like(after))
    starts = torch.zeros_like(marks)
    if s > 1:
        starts[:, 1:] = torch.cummax(marks[:, :-1], dim=1).values
    return starts


def make_batch(samples: torch.Tensor, eod_token: Optional[int], reset_position_ids: bool = False,
               reset_attention_mask: bool = False, eod_mask_loss: bool = False) -> dict:
    """``samples`` int64 [b, s+1] -> dict of tokens/labels [b, s], loss_mask float [b, s],
    position_ids int64 [b, s], attention_mask ``None`` or bool [b, 1, s, s] (True = may attend)."""
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
    if reset_attention_mask:
        causal = arange.unsqueeze(1) >= arange.unsqueeze(0)  # [q, k]
        same_segment = starts.unsqueeze(2) == starts.unsqueeze(1)  # [b, q, k]
        attention_mask = (causal.unsqueeze(0) & same_segment).unsqueeze(1)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "position_ids": position_ids, "attention_mask": attention_mask}
