"""Theoretical memory per GPU for a model, layout and batch (printed at start-up, like Megatron's
theoretical memory report), to compare with the measured peak after the first iterations.

Bytes per parameter held by a rank, as megatrain trains (parameters stay fp32 master weights,
matmuls run in bf16/fp16 under autocast):

    weights 4 + gradients 4 + Adam states 8 (SGD with momentum: 4)      fp32
    + 2 for the half-precision copy of the weights used by the matmuls (bf16/fp16 only: autocast's
      casts, or the gradient-accumulation fusion's persistent copies)

Data-parallel sharding (``--use-distributed-optimizer`` / ``--zero-stage``): ZeRO-1/2 divide the
fp32 weights, gradients and optimizer states by the data-parallel size, but the unsharded
half-precision (or, in fp32, full-precision) weights of every layer stay gathered between forward
and backward; ZeRO-3 keeps only about two layers gathered. Tensor parallelism divides the
transformer weights and the vocabulary by TP; pipeline parallelism divides the layers by PP.

Activations per transformer layer, in bytes, for sequence s, micro-batch b, hidden h, TP t
(flash/SDPA attention, so no s^2 score matrix is kept):
``s*b*h*(10 + 24/t)``, or ``34*s*b*h/t`` with sequence parallelism (Megatron's
"Reducing Activation Recomputation" accounting with the attention-score terms removed); with full
recomputation only each layer's input, ``2*s*b*h/t_sp``, plus one layer's full activations.
The output layer and loss hold the logits: ``s*b*V/t`` values in half precision plus their fp32
copy and gradient (10 bytes each); the chunked loss (``--cross-entropy-chunk-size``, also the
vocab-parallel one under TP) keeps only the half-precision logits (2 bytes each). Replicated data parallelism (DDP) adds its gradient buckets
(4 bytes per parameter). Under 1F1B pipeline parallelism the first stage holds the activations of
up to P micro-batches at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.models.gpt.config import GPTConfig

GIB = 2**30


@dataclass
class MemoryEstimate:
    parameters_total: int
    parameters_rank: int
    weights_and_grads: float  # bytes on this rank
    optimizer: float
    half_weights: float
    activations: float
    logits: float
    ddp_buckets: float = 0.0

    @property
    def total(self) -> float:
        return (self.weights_and_grads + self.optimizer + self.half_weights + self.activations + self.logits
                + self.ddp_buckets)

    def line(self) -> str:
        g = GIB
        return (f"theoretical memory per GPU: parameters {self.parameters_total:,} "
                f"(this rank {self.parameters_rank:,}) | weights+grads {self.weights_and_grads / g:.2f} GiB | "
                f"optimizer {self.optimizer / g:.2f} GiB | half-precision weights {self.half_weights / g:.2f} GiB | "
                f"activations {self.activations / g:.2f} GiB | logits {self.logits / g:.2f} GiB | "
                + (f"DDP buckets {self.ddp_buckets / g:.2f} GiB | " if self.ddp_buckets else "")
                + f"total {self.total / g:.2f} GiB")


def parameter_counts(cfg: GPTConfig) -> tuple[int, int, int]:
    """(transformer-layer parameters, embedding + output parameters, total) of the full model."""
    h, d, n, g, f = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_query_groups, cfg.ffn_hidden_size
    assert d is not None and g is not None and f is not None
    bias = cfg.add_bias_linear
    qkv = h * (n + 2 * g) * d + ((n + 2 * g) * d if bias or cfg.add_qkv_bias else 0)
    proj = n * d * h + (h if bias else 0)
    fc1_out = 2 * f if cfg.swiglu else f
    mlp = h * fc1_out + (fc1_out if bias else 0) + f * h + (h if bias else 0)
    norm = 2 * h if cfg.normalization == "LayerNorm" else h
    qk_norms = 2 * (2 * d if cfg.normalization == "LayerNorm" else d) if cfg.qk_layernorm else 0
    per_layer = qkv + qk_norms + proj + mlp + 2 * norm
    emb = cfg.vocab_size * h
    if cfg.position_embedding_type == "learned_absolute":
        emb += cfg.max_position_embeddings * h
    out = 0 if not cfg.untie_embeddings_and_output_weights else cfg.vocab_size * h
    extra = emb + out + norm  # final norm
    return per_layer * cfg.num_layers, extra, per_layer * cfg.num_layers + extra


def estimate_memory(cfg: GPTConfig, *, seq_length: int, micro_batch_size: int, tp: int = 1, pp: int = 1,
                    dp: int = 1, zero_stage: int = 0, sequence_parallel: bool = False,
                    recompute_granularity: str | None = None, half_precision: bool = True,
                    optimizer: str = "adam", loss_chunked: bool = False,
                    num_micro_batches: int = 1, cp: int = 1) -> MemoryEstimate:
    """Estimate the memory of the rank holding the first pipeline stage (the embedding)."""
    layers, extra, total = parameter_counts(cfg)
    layers_per_stage = cfg.num_layers // pp
    rank_params = int(layers / cfg.num_layers * layers_per_stage / tp + extra / tp)
    shard = dp * cp if zero_stage >= 1 else 1  # ZeRO shards over the data x context parallel ranks
    seq_length = seq_length // cp  # context parallel: each rank holds 1/cp of every sequence
    weights_and_grads = 8.0 * rank_params / shard
    opt_bytes = {"adam": 8.0, "sgd": 4.0}.get(optimizer, 8.0)
    optimizer_mem = opt_bytes * rank_params / shard
    gathered_bytes = 2.0 if half_precision else 4.0
    if zero_stage >= 3:
        gathered = gathered_bytes * rank_params / max(layers_per_stage, 1) * 2
    elif zero_stage >= 1 or half_precision:
        gathered = gathered_bytes * rank_params
    else:
        gathered = 0.0
    s, b, h = seq_length, micro_batch_size, cfg.hidden_size
    act_scale = 1.0 if half_precision else 2.0
    if sequence_parallel:
        per_layer = 34.0 * s * b * h / tp
    else:
        per_layer = s * b * h * (10.0 + 24.0 / tp)
    if recompute_granularity == "full":
        activations = (2.0 * s * b * h / (tp if sequence_parallel else 1)) * layers_per_stage + per_layer
    else:
        activations = per_layer * layers_per_stage
    activations *= act_scale
    if pp > 1:
        activations *= min(pp, num_micro_batches)  # 1F1B: micro-batches in flight on the first stage
        logits = 0.0  # on the last stage
    else:
        logits = (2.0 if loss_chunked else 10.0) * s * b * cfg.vocab_size / tp
    ddp = dp * cp > 1 and zero_stage == 0 and tp == 1 and pp == 1
    ddp_buckets = 4.0 * rank_params if ddp else 0.0
    return MemoryEstimate(total, rank_params, weights_and_grads, optimizer_mem, gathered, activations, logits,
                          ddp_buckets)
