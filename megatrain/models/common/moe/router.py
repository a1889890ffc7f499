"""The top-k router of a mixture-of-experts layer (Megatron-LM's ``TopKRouter`` and the routing
functions of its ``moe_utils``), and the expert-bias update of aux-loss-free balancing.

``TopKRouter(config, layer_number)(x [b, s, h])`` -> ``(probs [T, E], routing_map [T, E] bool)``
with ``T = b * s`` this rank's tokens: ``probs`` holds each token's weights of its chosen experts
(zeros elsewhere). In order, as Megatron:

1. in training, the input times uniform noise in ``[1 - eps, 1 + eps]`` (``--moe-input-jitter-eps``);
2. logits ``x @ W^T`` (a plain ``F.linear``: a tensor-parallel style may make ``x`` and ``W``
   DTensors; the rest works on the local tensors), in fp32 / fp64 with ``--moe-router-dtype``;
   (``--moe-router-force-load-balancing``, benchmarks: random normal logits, the gradient passed
   straight through);
3. in training, the z-loss attached to the logits;
4. scores and top-k: softmax over the chosen logits, or (``--moe-router-pre-softmax``) the top-k of a
   softmax over all; sigmoid / sqrt-softplus scores with the chosen ones normalised to sum 1 when
   ``topk > 1``; group-limited routing (``--moe-router-num-groups`` / ``--moe-router-group-topk``:
   the best groups by the sum of their top ``topk / group_topk`` scores, then the top-k inside them);
   the expert bias (``--moe-router-enable-expert-bias``) is added for the choice only; the weights
   times ``--moe-router-topk-scaling-factor``;
5. in training, the balancing losses (computed on the scores over all experts) attached to ``probs``.

Token dropping (``--moe-expert-capacity-factor``) is the dispatcher's (:mod:`.token_ops`).

Process groups, set from outside (None: one process): ``reduce_group`` holds the ranks with the
other tokens of the same sequences (tensor-parallel ranks under sequence parallelism, and
context-parallel ranks; Megatron's tp_cp group): the token counts of ``aux_loss`` / ``seq_aux_loss``
are summed over it; ``global_group`` (Megatron's tp_dp_cp): the counts of ``global_aux_loss`` and
of the expert bias.

Logged values (Megatron's ``load_balancing_loss``, ``seq_load_balancing_loss``,
``global_load_balancing_loss``, ``z_loss``: each loss without its coefficient) are summed over
micro-batches on the device in ``logged`` (read by :mod:`.metrics`). Nothing is recorded or counted
in eval mode, under ``torch.no_grad`` or in a recomputation (activation checkpointing re-runs the
forward inside the backward); a recomputation still attaches the same losses.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.compiler_disable import compiler_disable
from megatrain.models.common.config import TransformerConfig
from megatrain.models.common.moe import aux_loss as losses

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]

__all__ = ["TopKRouter", "topk_routing", "update_expert_biases", "reset_global_aux_loss", "moe_routers",
           "BALANCING_LOSS_NAMES", "in_recomputation"]

# Balancing type -> its logged name (Megatron's).
BALANCING_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                        "global_aux_loss": "global_load_balancing_loss"}
_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def in_recomputation() -> bool:
    """Whether a backward pass is running (a forward now is activation recomputation)."""
    return torch._C._current_graph_task_id() != -1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _topk(scores: torch.Tensor, k: int, num_groups: int | None, group_topk: int | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the last dim of ``scores`` [T, E]; group-limited as Megatron's ``group_limited_topk``."""
    if group_topk:
        assert num_groups is not None
        t, e = scores.shape
        grouped = scores.reshape(t, num_groups, e // num_groups)
        group_scores = grouped.topk(k // group_topk, dim=-1).values.sum(dim=-1)
        chosen = group_scores.topk(group_topk, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(-1, chosen, True)
        mask = group_mask.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, e)
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.topk(k, dim=-1)


def topk_routing(logits: torch.Tensor, topk: int, *, score_function: str = "softmax", pre_softmax: bool = False,
                 num_groups: int | None = None, group_topk: int | None = None,
                 scaling_factor: float | None = None, expert_bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``topk_routing_with_score_function``: (probs [T, E] in ``logits``' dtype, zeros
    where not routed; routing_map [T, E] bool) from ``logits`` [T, E]. The scores are float32."""
    if score_function == "softmax":
        if pre_softmax:
            probs, top = _topk(torch.softmax(logits, dim=-1, dtype=torch.float32), topk, num_groups, group_topk)
        else:
            chosen, top = _topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(chosen, dim=-1, dtype=torch.float32)
    elif score_function in ("sigmoid", "sqrtsoftplus"):
        scores = torch.sigmoid(logits.float()) if score_function == "sigmoid" else F.softplus(logits.float()).sqrt()
        if expert_bias is not None:  # the bias steers the choice; the weights are the scores
            _, top = _topk(scores + expert_bias.float(), topk, num_groups, group_topk)
            probs = scores.gather(-1, top)
        else:
            probs, top = _topk(scores, topk, num_groups, group_topk)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"--moe-router-score-function: unknown score function {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.to(logits.dtype)
    routing_probs = torch.zeros_like(logits).scatter(-1, top, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, top, True)
    return routing_probs, routing_map


class TopKRouter(nn.Module):
    """Routes each token to its top-k experts (see the module doc). ``layer_number``: the layer's
    0-based index in the whole model (where its logged values go)."""

    def __init__(self, config: TransformerConfig, layer_number: int = 0) -> None:
        super().__init__()
        assert config.num_moe_experts is not None, "a router needs --num-experts"
        self.config = config
        self.layer_number = layer_number
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        # Process groups (parallel code sets them): see the module doc.
        self.reduce_group: Any = None
        self.global_group: Any = None
        # --calculate-per-token-loss (the trainer sets it): the losses are pre-multiplied by the tokens.
        self.calculate_per_token_loss = False
        # Running state, plain tensors created on first use (not buffers: DDP would broadcast rank 0's).
        self.logged: dict[str, torch.Tensor] = {}  # name -> sum over micro-batches of the value
        self.local_tokens_per_expert: torch.Tensor | None = None  # expert bias: tokens routed this iteration
        self.global_tokens_per_expert: torch.Tensor | None = None  # global_aux_loss: running counts ...
        self.global_steps = 0  # ... over this many micro-batches

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, topk={self.topk}, score={self.config.moe_router_score_function}, "
                f"layer={self.layer_number}")

    def _apply(self, fn: Any, recurse: bool = True) -> "TopKRouter":
        # A model built on the meta device is materialised with to_empty: the expert bias starts at
        # 0. It stays float32 when the model is cast (as Megatron keeps it).
        was_meta = self.expert_bias is not None and self.expert_bias.is_meta
        out = super()._apply(fn, recurse)
        bias = self.expert_bias
        if bias is not None:
            if bias.dtype != torch.float32:
                self._buffers["expert_bias"] = bias = bias.float()
            if was_meta and not bias.is_meta:
                with torch.no_grad():
                    bias.zero_()
        return out

    # ---- forward ---------------------------------------------------------------------------------
    def gating(self, x: torch.Tensor) -> torch.Tensor:
        """The router logits ``x @ W^T`` (local tensor), in --moe-router-dtype when given."""
        dtype = _DTYPES.get(self.config.moe_router_dtype or "")
        if dtype is None:
            logits = F.linear(x, self.weight)
        else:
            with torch.autocast(device_type=_local(x).device.type, enabled=False):
                logits = F.linear(x.to(dtype), self.weight.to(dtype))
        return _local(logits)

    def _jitter(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.config.moe_input_jitter_eps
        local = _local(x)
        noise = torch.empty_like(local).uniform_(1.0 - eps, 1.0 + eps)
        if isinstance(x, DTensor):
            noise = DTensor.from_local(noise, x.device_mesh, x.placements, run_check=False)
        return x * noise

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        training = self.training and torch.is_grad_enabled()
        if training and cfg.moe_input_jitter_eps:
            x = self._jitter(x)
        logits = self.gating(x)
        if cfg.moe_router_force_load_balancing:  # random values, the gradient straight through (Megatron's RandomSTE)
            logits = logits + (torch.randn_like(logits) - logits).detach()
        b = logits.shape[0] if logits.dim() == 3 else 1  # sequences, for seq_aux_loss
        logits = logits.reshape(-1, self.num_experts)
        if training and cfg.moe_z_loss_coeff is not None:
            logits = self._attach_z_loss(logits)
        probs, routing_map = topk_routing(
            logits, self.topk, score_function=cfg.moe_router_score_function, pre_softmax=cfg.moe_router_pre_softmax,
            num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk,
            scaling_factor=cfg.moe_router_topk_scaling_factor, expert_bias=self.expert_bias)
        if training and any(cfg.aux_loss_coeff(t) > 0 for t in BALANCING_LOSS_NAMES):
            probs = self._attach_balancing_losses(logits, probs, b)
        if training and self.expert_bias is not None:
            self._count_tokens(routing_map)
        return probs, routing_map

    # ---- losses and records (eager: they keep state) ---------------------------------------------
    def _per_token_factor(self, num_tokens: int) -> float:
        """Megatron's pre-multiplication under --calculate-per-token-loss (the trainer divides every
        gradient by the global batch's loss tokens): the tokens of the sequences' parts."""
        return float(num_tokens * losses.group_size(self.reduce_group)) if self.calculate_per_token_loss else 1.0

    @compiler_disable
    def _record(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        acc = self.logged.get(name)
        if acc is None:
            self.logged[name] = value.clone()
        else:
            acc.add_(value)

    @compiler_disable
    def _attach_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        # Each rank's z-loss is the mean over its own tokens: Megatron divides the coefficient by the
        # reduce group's size (the ranks' losses average rather than add up).
        raw = losses.z_loss(logits, 1.0)
        coeff = self.config.moe_z_loss_coeff / losses.group_size(self.reduce_group)
        loss = raw * (coeff * self._per_token_factor(logits.shape[0]))
        if not in_recomputation():
            self._record("z_loss", raw)
        return losses.attach_aux_loss(logits, loss)

    @compiler_disable
    def _attach_balancing_losses(self, logits: torch.Tensor, probs: torch.Tensor, b: int) -> torch.Tensor:
        cfg = self.config
        recomputing = in_recomputation()
        routing_map, scores = losses.routing_scores_for_aux_loss(logits, self.topk, cfg.moe_router_score_function)
        t, e = scores.shape
        for kind, name in BALANCING_LOSS_NAMES.items():
            coeff = cfg.aux_loss_coeff(kind)
            if coeff <= 0:
                continue
            if kind == "aux_loss":
                counts = losses.tokens_per_expert(routing_map, self.reduce_group)
                raw = losses.switch_load_balancing_loss(scores, counts, t * losses.group_size(self.reduce_group),
                                                        self.topk, 1.0)
            elif kind == "seq_aux_loss":
                s = t // b
                counts = losses.tokens_per_expert(routing_map.reshape(b, s, e), self.reduce_group)
                raw = losses.sequence_load_balancing_loss(scores.reshape(b, s, e), counts,
                                                          s * losses.group_size(self.reduce_group), self.topk, 1.0)
            else:  # global_aux_loss: the counts of the iteration's micro-batches so far, averaged
                counts = losses.tokens_per_expert(routing_map, self.global_group)
                if self.global_tokens_per_expert is None:
                    self.global_tokens_per_expert = torch.zeros_like(counts)
                if not recomputing:
                    self.global_tokens_per_expert += counts
                    self.global_steps += 1
                average = self.global_tokens_per_expert / max(self.global_steps, 1)
                raw = losses.switch_load_balancing_loss(scores, average, t * losses.group_size(self.global_group),
                                                        self.topk, 1.0)
            probs = losses.attach_aux_loss(probs, raw * (coeff * self._per_token_factor(t)))
            if not recomputing:
                self._record(name, raw)
        return probs

    @compiler_disable
    def _count_tokens(self, routing_map: torch.Tensor) -> None:
        if in_recomputation():
            return
        with torch.no_grad():
            counts = routing_map.sum(dim=0, dtype=torch.float32)
            if self.local_tokens_per_expert is None:
                self.local_tokens_per_expert = counts
            else:
                self.local_tokens_per_expert += counts

    def reset_global_aux_loss(self) -> None:
        """Start the next iteration's global_aux_loss counts."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
        self.global_steps = 0


def moe_routers(modules: nn.Module | Iterable[nn.Module]) -> list[TopKRouter]:
    """The routers in ``modules`` (a model or several stages), each once, in module order."""
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    seen: set[int] = set()
    out = []
    for root in roots:
        for m in root.modules():
            if isinstance(m, TopKRouter) and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


@torch.no_grad()
def update_expert_biases(modules: nn.Module | Iterable[nn.Module]) -> None:
    """Aux-loss-free balancing, after the iteration's last backward: each router's token counts
    summed over its ``global_group``, then ``bias += rate * sign(mean count - count)``; the counts
    start again from zero. One all-reduce per group for all its routers. Every rank of a group must
    call it (the routers that never ran count zero tokens)."""
    routers = [r for r in moe_routers(modules) if r.expert_bias is not None]
    by_group: dict[int, list[TopKRouter]] = {}
    for r in routers:
        by_group.setdefault(id(r.global_group), []).append(r)
    for group_routers in by_group.values():
        group = group_routers[0].global_group
        counts = torch.stack([r.local_tokens_per_expert if r.local_tokens_per_expert is not None
                              else torch.zeros_like(r.expert_bias) for r in group_routers]).float()
        if losses.group_size(group) > 1:
            torch.distributed.all_reduce(counts, group=group)
        rate = group_routers[0].config.moe_router_bias_update_rate  # one config for the model's routers
        steps = torch.sign(counts.mean(dim=-1, keepdim=True) - counts) * rate
        torch._foreach_add_([r.expert_bias for r in group_routers], list(steps.unbind(0)))
        for r in group_routers:
            if r.local_tokens_per_expert is not None:
                r.local_tokens_per_expert.zero_()


def reset_global_aux_loss(modules: nn.Module | Iterable[nn.Module]) -> None:
    """After each training iteration: the global_aux_loss counts start again (Megatron's
    ``reset_global_aux_loss_tracker``)."""
    for r in moe_routers(modules):
        r.reset_global_aux_loss()
