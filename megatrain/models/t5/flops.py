"""FLOPs of one T5 training iteration (what the log line's TFLOP/s and MFU divide).

Megatron-LM has no T5 formula (its ``num_floating_point_operations`` counts every model as a
decoder-only stack of ``--num-layers`` layers over ``--seq-length`` tokens), so this counts the
model's matmuls with the terms of GUIDE §3.4, each matmul 2 m k n forward and twice that backward
(hence the 6). B global batch, s_e encoder and s_d decoder length, L_e / L_d the layers, h hidden,
n heads, d head dim, F ffn hidden, V padded vocabulary, E = 3 with SwiGLU else 2:

    encoder  B s_e L_e [6 h E F + 6 h d 3n + 6 d n h]  +  12 B s_e^2 L_e n d    (bidirectional: every score)
    decoder  B s_d L_d [6 h E F + 6 h d 3n + 6 d n h]  +   6 B s_d^2 L_d n d    (causal: half the scores)
    cross    B L_d [6 s_d h n d + 6 s_e h 2 n d + 6 s_d n d h]  +  12 B s_d s_e L_d n d
    logits   6 B s_d h V

(T5 has no grouped-query attention, so g = n.) The relative position bias, norms and softmax are
left out, as Megatron leaves them out of its formula.
"""

from __future__ import annotations

from megatrain.models.t5.config import T5Config

__all__ = ["num_floating_point_operations"]


def num_floating_point_operations(cfg: T5Config, batch_size: int, seq_length: int) -> float:
    """Model FLOPs of one iteration over ``batch_size`` samples: ``seq_length`` encoder tokens and the
    config's ``decoder_seq_length`` (default the same) decoder tokens each."""
    assert cfg.ffn_hidden_size is not None and cfg.kv_channels is not None
    B, se = batch_size, seq_length
    sd = cfg.decoder_seq_length or seq_length
    h, n, d, F, V = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels, cfg.ffn_hidden_size, cfg.vocab_size
    Le, Ld = cfg.num_layers, cfg.decoder_layers
    E = 3 if cfg.swiglu else 2
    per_token_layer = 6 * h * E * F + 6 * h * d * 3 * n + 6 * d * n * h  # MLP, QKV, output projection
    encoder = B * se * Le * per_token_layer + 12 * B * se * se * Le * n * d
    decoder = B * sd * Ld * per_token_layer + 6 * B * sd * sd * Ld * n * d
    cross = B * Ld * (6 * sd * h * n * d + 6 * se * h * 2 * n * d + 6 * sd * n * d * h) + 12 * B * sd * se * Ld * n * d
    logits = 6 * B * sd * h * V
    return float(encoder + decoder + cross + logits)
