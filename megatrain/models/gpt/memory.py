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

Mixture-of-experts layers (Megatron's ``report_theoretical_memory`` split): the routed experts are not
split by tensor parallelism but over the ``expert_parallel_size`` ranks, and ZeRO shards their fp32
state over the expert-data-parallel ranks (``dp x cp x tp / ep``); the router and the shared-expert
gate are replicated; the shared experts are split by tensor parallelism like a dense MLP. The line
also gives the active parameters (each token's top-k experts instead of all of them). Activations are
counted as for the dense layers (as Megatron's activation formula does).

Multi-latent attention (``--multi-latent-attention``, :mod:`megatrain.models.common.mla`): the layer's
attention parameters are its modules' own: ``linear_q_proj`` [n(P+R), h] or ``linear_q_down_proj``
[Q, h] + ``q_layernorm`` [Q] + ``linear_q_up_proj`` [n(P+R), Q], ``linear_kv_down_proj`` [C+R, h] +
``kv_layernorm`` [C] + ``linear_kv_up_proj`` [n(P+V), C], ``linear_proj`` [h, nV] (+ bias), the latent
norms only with ``--qk-layernorm``. Under tensor parallelism the down projections and the latent norms
are replicated (every rank holds them whole), the up projections, ``linear_q_proj`` and ``linear_proj``
split.
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
    parameters_active: int | None = None  # mixture of experts: the parameters one token passes through

    @property
    def total(self) -> float:
        return (self.weights_and_grads + self.optimizer + self.half_weights + self.activations + self.logits
                + self.ddp_buckets)

    def line(self) -> str:
        g = GIB
        active = f"active {self.parameters_active:,}, " if self.parameters_active is not None else ""
        return (f"theoretical memory per GPU: parameters {self.parameters_total:,} "
                f"({active}this rank {self.parameters_rank:,}) | weights+grads {self.weights_and_grads / g:.2f} GiB | "
                f"optimizer {self.optimizer / g:.2f} GiB | half-precision weights {self.half_weights / g:.2f} GiB | "
                f"activations {self.activations / g:.2f} GiB | logits {self.logits / g:.2f} GiB | "
                + (f"DDP buckets {self.ddp_buckets / g:.2f} GiB | " if self.ddp_buckets else "")
                + f"total {self.total / g:.2f} GiB")


@dataclass(frozen=True)
class LayerParameters:
    """Parameters of one layer of each kind, by how the parallel layouts hold them."""

    dense: int  # a dense layer (split by tensor parallelism)
    moe_tp: int  # a MoE layer's attention, norms and shared experts (split by tensor parallelism)
    moe_replicated: int  # its router and shared-expert gate
    moe_experts: int  # its routed experts (split over the expert-parallel ranks)
    moe_experts_active: int  # the top-k experts one token passes through
    # of ``dense`` and of ``moe_tp``: the attention parameters every tensor-parallel rank holds whole
    # (multi-latent attention's down projections and latent norms)
    tp_replicated: int = 0


def _mla_attention(cfg: GPTConfig) -> tuple[int, int]:
    """Multi-latent attention's (parameters, of them the ones replicated across tensor-parallel ranks)."""
    h, n = cfg.hidden_size, cfg.num_attention_heads
    P, R, V, C, Q = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank

    def norm(width: int) -> int:
        return (2 * width if cfg.normalization == "LayerNorm" else width) if cfg.qk_layernorm else 0

    split = n * (P + V) * C + n * V * h + (h if cfg.add_bias_linear else 0)  # kv up, output projection
    replicated = (C + R) * h + norm(C)  # kv down projection, kv_layernorm
    if Q is None:
        split += n * (P + R) * h  # linear_q_proj
    else:
        split += n * (P + R) * Q  # linear_q_up_proj
        replicated += Q * h + norm(Q)  # linear_q_down_proj, q_layernorm
    return split + replicated, replicated


def layer_parameters(cfg: GPTConfig) -> LayerParameters:
    """One dense and one mixture-of-experts layer's parameters (the model's own modules)."""
    h, d, n, g, f = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_query_groups, cfg.ffn_hidden_size
    assert d is not None and g is not None and f is not None
    bias = cfg.add_bias_linear
    norm = 2 * h if cfg.normalization == "LayerNorm" else h
    replicated = 0
    if getattr(cfg, "multi_latent_attention", False):
        attention, replicated = _mla_attention(cfg)
    else:
        qkv = h * (n + 2 * g) * d + ((n + 2 * g) * d if bias or cfg.add_qkv_bias else 0)
        proj = n * d * h + (h if bias else 0)
        qk_norms = 2 * (2 * d if cfg.normalization == "LayerNorm" else d) if cfg.qk_layernorm else 0
        attention = qkv + qk_norms + proj
    common = attention + 2 * norm

    def mlp(width: int, with_bias: bool) -> int:
        fc1_out = 2 * width if cfg.swiglu else width
        return h * fc1_out + (fc1_out if with_bias else 0) + width * h + (h if with_bias else 0)

    dense = common + mlp(f, bias)
    if cfg.num_moe_experts is None:
        return LayerParameters(dense, 0, 0, 0, 0, replicated)
    experts = mlp(cfg.moe_ffn, bias)
    shared_width = cfg.moe_shared_expert_intermediate_size
    shared = mlp(shared_width, False) if shared_width is not None else 0  # the shared experts have no biases
    gate = h if shared_width is not None and cfg.moe_shared_expert_gate else 0
    return LayerParameters(dense, common + shared, cfg.num_moe_experts * h + gate, cfg.num_moe_experts * experts,
                           cfg.moe_router_topk * experts, replicated)


def _embedding_parameters(cfg: GPTConfig) -> int:
    h = cfg.hidden_size
    emb = cfg.vocab_size * h
    if cfg.position_embedding_type == "learned_absolute":
        emb += cfg.max_position_embeddings * h
    out = 0 if not cfg.untie_embeddings_and_output_weights else cfg.vocab_size * h
    norm = 2 * h if cfg.normalization == "LayerNorm" else h
    mtp = cfg.mtp_built_layers * (3 * norm + 2 * h * h)  # each depth's enorm, hnorm, final norm and eh_proj
    return emb + out + norm + mtp  # final norm


def _layer_counts(cfg: GPTConfig) -> tuple[int, int]:
    """(dense, MoE) layers, multi-token prediction's depths included (each of the last layer's kind)."""
    moe = cfg.num_moe_layers + cfg.mtp_moe_layers if cfg.num_moe_experts is not None else 0
    return cfg.num_layers + cfg.mtp_built_layers - moe, moe


def parameter_counts(cfg: GPTConfig) -> tuple[int, int, int]:
    """(transformer-layer parameters, embedding + output parameters, total) of the full model."""
    p, (dense, moe) = layer_parameters(cfg), _layer_counts(cfg)
    layers = p.dense * dense + (p.moe_tp + p.moe_replicated + p.moe_experts) * moe
    extra = _embedding_parameters(cfg)
    return layers, extra, layers + extra


def active_parameter_count(cfg: GPTConfig) -> int:
    """The parameters one token passes through (Megatron's "active parameters"): the total with each
    MoE layer's routed experts counted ``topk`` times instead of ``E`` times."""
    p, (_, moe) = layer_parameters(cfg), _layer_counts(cfg)
    return parameter_counts(cfg)[2] - (p.moe_experts - p.moe_experts_active) * moe


def estimate_memory(cfg: GPTConfig, *, seq_length: int, micro_batch_size: int, tp: int = 1, pp: int = 1,
                    dp: int = 1, zero_stage: int = 0, sequence_parallel: bool = False,
                    recompute_granularity: str | None = None, half_precision: bool = True,
                    optimizer: str = "adam", loss_chunked: bool = False,
                    num_micro_batches: int = 1, cp: int = 1, expert_parallel_size: int = 1) -> MemoryEstimate:
    """Estimate the memory of the rank holding the first pipeline stage (the embedding)."""
    _, extra, total = parameter_counts(cfg)
    p, (dense, moe) = layer_parameters(cfg), _layer_counts(cfg)
    layers_per_stage = cfg.num_layers // pp
    stage = layers_per_stage / cfg.num_layers  # the stage's share of the layers (on average)
    ep = max(expert_parallel_size, 1)
    replicated = p.tp_replicated * (dense + moe)  # held whole by every tensor-parallel rank
    rank_dense = int(((p.dense * dense + p.moe_tp * moe - replicated) * stage + extra) / tp
                     + (p.moe_replicated * moe + replicated) * stage)
    rank_experts = int(p.moe_experts * moe * stage / ep)
    rank_params = rank_dense + rank_experts
    # ZeRO shards over the data x context parallel ranks; the experts over the expert-data-parallel ones
    shard = dp * cp if zero_stage >= 1 else 1
    expert_shard = max(dp * cp * tp // ep, 1) if zero_stage >= 1 else 1
    sharded = rank_dense / shard + rank_experts / expert_shard
    seq_length = seq_length // cp  # context parallel: each rank holds 1/cp of every sequence
    weights_and_grads = 8.0 * sharded
    opt_bytes = {"adam": 8.0, "sgd": 4.0}.get(optimizer, 8.0)
    optimizer_mem = opt_bytes * sharded
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
    active = active_parameter_count(cfg) if moe else None
    return MemoryEstimate(total, rank_params, weights_and_grads, optimizer_mem, gathered, activations, logits,
                          ddp_buckets, active)
