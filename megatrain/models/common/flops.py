"""Megatron-LM's model FLOPs of one training iteration of a transformer stack (what the log line's
TFLOP/s and MFU divide), for every family that Megatron counts with its transformer formula.

B global batch, s sequence length, h hidden, L layers, n heads, g query groups, d head dim,
F ffn hidden, V padded vocabulary and E = 3 with SwiGLU (fc1 is twice as wide) else 2:

    FLOPs = B*s*[6*h*E*F*L + 6*L*(h*d*(n+2g) + d*n*h) + 6*h*V] + 6*B*s^2*L*n*d

Every matmul costs 2*m*k*n forward and twice that backward (gradients of input and weight),
hence the 6. The last term is attention: QK^T and attention x V over half of the s x s score
matrix (Megatron counts causal attention; it uses the same formula for BERT, so bidirectional
attention is counted at half its cost there, as in Megatron's logs).

Mixture-of-experts models (Megatron's MoE terms): ``F*L`` becomes the dense layers' ``F`` plus, per MoE
layer, ``topk`` routed experts of width ``moe_ffn_hidden_size`` and the shared experts' width ``S``:

    F*L  ->  F*L_dense + (F_moe*topk + S)*L_moe

(``L_moe`` from ``--moe-layer-freq``). Megatron counts neither the router's logits nor the token
movement nor capacity padding; nor does this.

Multi-latent attention (``--multi-latent-attention``; Megatron's MLA branch of
``num_floating_point_operations``), with P = --qk-head-dim, R = --qk-pos-emb-head-dim, V = --v-head-dim,
C = --kv-lora-rank, Q = --q-lora-rank, replaces the attention terms per layer by

    6*B*s*[q + C*(h + n*(P+V) + 1) + h*R + n*V*h] + 6*B*s^2*(n*(P+R)/2 + n*V/2)

with q = h*n*(P+R) without --q-lora-rank, else Q*(h + n*(P+R) + 1) (the "+ 1"s are Megatron's count of
the latent norms, counted with or without --qk-layernorm as Megatron does).

Multi-token prediction (``--mtp-num-layers D``; Megatron's count): each depth's layer counts as one more
layer of the last layer's kind (L -> L + D in every term), each depth adds its norms and projection,
6*B*s*(3*h + 2*h^2), and its logits, 6*B*s*h*V.
"""

from __future__ import annotations

from megatrain.models.common.config import TransformerConfig

__all__ = ["transformer_flops"]


def transformer_flops(cfg: TransformerConfig, batch_size: int, seq_length: int) -> float:
    """Model FLOPs of one iteration over ``batch_size`` sequences of ``seq_length`` tokens."""
    assert cfg.ffn_hidden_size is not None and cfg.kv_channels is not None and cfg.num_query_groups is not None
    B, s = batch_size, seq_length
    D = getattr(cfg, "mtp_num_layers", 0)  # multi-token prediction depths: one layer each
    h, L, V = cfg.hidden_size, cfg.num_layers + D, cfg.vocab_size
    n, g, d, F = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels, cfg.ffn_hidden_size
    E = 3 if cfg.swiglu else 2
    moe_layers = 0
    if getattr(cfg, "num_moe_experts", None) is not None:  # every depth runs a layer (a repeated one too)
        moe_layers = cfg.num_moe_layers + (D if D and cfg.is_moe_layer(cfg.num_layers - 1) else 0)
    mlp_width = F * (L - moe_layers)  # summed over the layers
    if moe_layers:
        shared = cfg.moe_shared_expert_intermediate_size or 0
        mlp_width += (cfg.moe_ffn * cfg.moe_router_topk + shared) * moe_layers
    if getattr(cfg, "multi_latent_attention", False):
        attn_linear, attn_core2 = _mla_terms(cfg)
    else:
        attn_linear, attn_core2 = h * d * (n + 2 * g) + d * n * h, 2 * n * d
    per_token = 6 * h * E * mlp_width + 6 * L * attn_linear + 6 * h * V * (1 + D) + 6 * D * (3 * h + 2 * h * h)
    attention = 3 * B * s * s * L * attn_core2  # 6 * B * s^2 * L * (core / 2): exact in integers
    return float(B * s * per_token + attention)


def _mla_terms(cfg: TransformerConfig) -> tuple[int, int]:
    """Multi-latent attention's (token-linear matmul size, twice the per-token core-attention size) per
    layer: Megatron's ``q_term + kv term + h*R + o proj`` and ``n*(P+R) + n*V``."""
    h, n = cfg.hidden_size, cfg.num_attention_heads
    P, R, V, C = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        q_term = h * n * (P + R)
    else:
        q_term = cfg.q_lora_rank * (h + n * (P + R) + 1)
    linear = q_term + C * (h + n * (P + V) + 1) + h * R + n * V * h
    return linear, n * (P + R) + n * V
