"""Rotary position embeddings (RoPE), computed on the fly from position ids.

Convention: the non-interleaved ("rotate half") form used by Hugging Face LLaMA and Megatron's
default. Dimension i of the first half of a head pairs with dimension i + d/2, and the pair is
rotated by the angle ``position * base ** (-2i / d)``. Nothing is stored in the module (no buffers),
so models build on the meta device and checkpoints hold parameters only.

The model computes the (cos, sin) tables once per forward (:func:`rotary_tables`) and hands them to
every layer. Computed inside each layer, torch.compile fused the cos/sin into the rotation kernels
and evaluated them once per element of every head (about 30 ms of a LLaMA 1.2B step on an H200);
a whole-model compile did the same with shared tables. So the tables come from a custom operator
(``megatrain::rotary_cos_sin``), which the compiler runs as one opaque kernel: its output is a
stored tensor that the rotations only read.

Llama 3.x RoPE scaling (Megatron's ``--use-rope-scaling``, Hugging Face's ``rope_type: "llama3"``)
changes the inverse frequencies once, before any angle is formed (:func:`llama3_scaled_inv_freq`);
the positions stay as they are.

Multi-latent attention rotates its own ``--qk-pos-emb-head-dim`` dims, with YaRN frequencies by default
(Megatron's ``YarnRotaryEmbedding``, :func:`yarn_inv_freq`): tables from :func:`mla_rotary_tables`.

Interleaved RoPE (Megatron's ``--rotary-interleaved``) pairs adjacent dims instead: (x0, x1), (x2, x3),
..., pair i rotated by the same angle ``position * base ** (-2i / d)``; the tables then repeat each
angle twice in place ([a0, a0, a1, a1, ...]) instead of laying out two copies ([a0, a1, ..., a0, a1, ...]).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

# (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) of Llama 3.x scaling
RopeScaling = tuple[float, float, float, float]


def rope_scaling_of(config) -> RopeScaling | None:
    """The Llama 3.x scaling parameters of a config with ``--use-rope-scaling``, else None."""
    if not getattr(config, "use_rope_scaling", False):
        return None
    return (float(config.rope_scaling_factor), float(config.rope_scaling_low_freq_factor),
            float(config.rope_scaling_high_freq_factor), float(config.rope_scaling_original_max_position_embeddings))


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                           original_max_position_embeddings: float) -> torch.Tensor:
    """Llama 3.x's adjustment of RoPE inverse frequencies (Megatron's ``_apply_scaling``).

    With L the original context length, a dimension pair whose wavelength 2 pi / f is longer than
    L / low_freq_factor (fewer than low_freq_factor turns over the original context) is slowed down by
    ``factor``; one shorter than L / high_freq_factor keeps its frequency; in between, the frequency
    is the mix (1 - t) f / factor + t f, with t = (L / wavelength - low) / (high - low) going from 0 to 1
    across the band.
    """
    context = original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = context / low_freq_factor  # longer than this: divided by factor
    high_freq_wavelength = context / high_freq_factor  # shorter than this: unchanged
    slowed = torch.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    t = (context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mixed = (1 - t) * slowed / factor + t * slowed
    in_band = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(in_band, mixed, slowed)


def rotary_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None = None,
                    device: torch.device | None = None) -> torch.Tensor:
    """The inverse frequencies base ** (-2i / head_dim) of the head_dim / 2 dimension pairs, float32,
    adjusted by Llama 3.x ``scaling`` when given."""
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponent)  # [d/2]
    if scaling is not None:
        inv_freq = llama3_scaled_inv_freq(inv_freq, *scaling)
    return inv_freq


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float,
                   scaling: Optional[list[float]] = None,
                   interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each [*position_ids.shape, head_dim], in float32.

    ``scaling``: Llama 3.x's (factor, low_freq_factor, high_freq_factor, original context), or None.
    ``interleaved``: the layout of ``--rotary-interleaved`` (each angle repeated in place)."""
    llama3 = None if scaling is None else (scaling[0], scaling[1], scaling[2], scaling[3])
    inv_freq = rotary_inv_freq(head_dim, base, llama3, device=position_ids.device)
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., d/2]
    if interleaved:  # [..., d]: dims 2i and 2i + 1 of a pair share angle i
        angles = torch.repeat_interleave(angles, 2, dim=-1)
    else:
        angles = torch.cat((angles, angles), dim=-1)  # [..., d]: both halves of a pair share an angle
    return angles.cos(), angles.sin()


@torch.library.custom_op("megatrain::rotary_cos_sin", mutates_args=())
def _rotary_cos_sin_op(position_ids: torch.Tensor, head_dim: int, base: float,
                       scaling: Optional[list[float]] = None,
                       interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rotary_cos_sin(position_ids, head_dim, base, scaling, interleaved)
    return cos.contiguous(), sin.contiguous()


@_rotary_cos_sin_op.register_fake
def _(position_ids: torch.Tensor, head_dim: int, base: float,
      scaling: Optional[list[float]] = None, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*position_ids.shape, head_dim)
    return (position_ids.new_empty(shape, dtype=torch.float32), position_ids.new_empty(shape, dtype=torch.float32))


def _scaling_arg(scaling: RopeScaling | None) -> list[float] | None:
    return list(scaling) if scaling is not None else None


def yarn_inv_freq(dim: int, base: float, factor: float, original_context: float, beta_fast: float,
                  beta_slow: float, device: torch.device | None = None) -> torch.Tensor:
    """YaRN's inverse frequencies of ``dim / 2`` pairs (Megatron's ``YarnRotaryEmbedding``, Hugging Face's
    ``rope_type: "yarn"``): pairs that turn more than ``beta_fast`` times over the original context keep
    their frequency, those turning fewer than ``beta_slow`` times are slowed by ``factor``, a linear ramp
    between (the ramp's ends rounded outwards to whole pairs and clamped to the dims)."""
    extra = rotary_inv_freq(dim, base, device=device)
    inter = extra / factor

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: the pair keeps its frequency (extrapolation), 0: slowed by the factor
    return inter * (1 - keep) + extra * keep


def mla_cos_sin(position_ids: torch.Tensor, dim: int, base: float,
                yarn: Optional[list[float]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [*position_ids.shape, dim] (float32, the two-halves layout) of multi-latent attention's
    rotated dims. ``yarn``: (factor, original context, beta_fast, beta_slow, concentration) — the tables
    are then YaRN's, multiplied by the concentration (Megatron's ``_mscale``); None: plain RoPE."""
    if yarn is None:
        inv_freq, concentration = rotary_inv_freq(dim, base, device=position_ids.device), 1.0
    else:
        inv_freq = yarn_inv_freq(dim, base, yarn[0], yarn[1], yarn[2], yarn[3], device=position_ids.device)
        concentration = yarn[4]
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos() * concentration, angles.sin() * concentration


@torch.library.custom_op("megatrain::mla_cos_sin", mutates_args=())
def _mla_cos_sin_op(position_ids: torch.Tensor, dim: int, base: float,
                    yarn: Optional[list[float]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = mla_cos_sin(position_ids, dim, base, yarn)
    return cos.contiguous(), sin.contiguous()


@_mla_cos_sin_op.register_fake
def _(position_ids: torch.Tensor, dim: int, base: float,
      yarn: Optional[list[float]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*position_ids.shape, dim)
    return (position_ids.new_empty(shape, dtype=torch.float32), position_ids.new_empty(shape, dtype=torch.float32))


def mla_rotary_tables(config, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [b or 1, s, qk_pos_emb_head_dim] of a multi-latent-attention model (``--rope-type``)."""
    yarn = None
    if config.rope_type == "yarn":
        from megatrain.models.common.mla_config import yarn_mscale

        factor = float(config.rotary_scaling_factor)
        concentration = yarn_mscale(factor, config.mscale) / yarn_mscale(factor, config.mscale_all_dim)
        yarn = [factor, float(config.yarn_original_max_position_embeddings), float(config.yarn_beta_fast),
                float(config.yarn_beta_slow), float(concentration)]
    return _mla_cos_sin_op(position_ids, config.qk_pos_emb_head_dim, float(config.rotary_base), yarn)


def rotary_tables(config, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(cos, sin) [b or 1, s, rotary dim] in float32 for the layers of a RoPE model, else None
    (multi-latent attention: its own rotated dims' tables, whatever --position-embedding-type).

    Computed by an opaque custom operator, so that a compiled model stores the tables once instead
    of fusing the cos/sin evaluation into every layer's rotation kernels."""
    if getattr(config, "multi_latent_attention", False):
        return mla_rotary_tables(config, position_ids)
    if config.position_embedding_type != "rope":
        return None
    return _rotary_cos_sin_op(position_ids, config.rotary_dim, float(config.rotary_base),
                              _scaling_arg(rope_scaling_of(config)), bool(getattr(config, "rotary_interleaved", False)))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim, split into its first and second half."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [-x1, x0, -x3, x2, ...] over the last dim (adjacent pairs)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def apply_rotary(x_bnsd: torch.Tensor, cos_bsd: torch.Tensor, sin_bsd: torch.Tensor,
                 interleaved: bool = False) -> torch.Tensor:
    """Rotate queries or keys [b, heads, s, d] by cos/sin [b or 1, s, r] (broadcast over heads).

    With r < d (``--rotary-percent`` below 1) only the first r dims rotate; the rest pass through.
    ``interleaved`` (``--rotary-interleaved``, tables from ``rotary_cos_sin(..., interleaved=True)``):
    the pairs are adjacent dims (2i, 2i + 1) of those r instead of (i, i + r/2).
    """
    cos = cos_bsd.unsqueeze(1).to(x_bnsd.dtype)
    sin = sin_bsd.unsqueeze(1).to(x_bnsd.dtype)
    rotate = rotate_interleaved if interleaved else rotate_half
    r = cos.shape[-1]
    if r < x_bnsd.shape[-1]:
        rot, rest = x_bnsd[..., :r], x_bnsd[..., r:]
        return torch.cat((rot * cos + rotate(rot) * sin, rest), dim=-1)
    return x_bnsd * cos + rotate(x_bnsd) * sin


class RotaryEmbedding(nn.Module):
    """Parameter-free module that turns position ids into (cos, sin) for one head dim (with Llama 3.x
    ``scaling`` of the frequencies when given)."""

    def __init__(self, head_dim: int, base: float, scaling: RopeScaling | None = None,
                 interleaved: bool = False) -> None:
        super().__init__()
        assert head_dim % 2 == 0, "rotary embeddings need an even head dim"
        self.head_dim = head_dim
        self.base = base
        self.scaling = scaling
        self.interleaved = interleaved

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _rotary_cos_sin_op(position_ids, self.head_dim, float(self.base), _scaling_arg(self.scaling),
                                  self.interleaved)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, base={self.base}"
                + (f", llama3 scaling={self.scaling}" if self.scaling is not None else "")
                + (", interleaved" if self.interleaved else ""))
