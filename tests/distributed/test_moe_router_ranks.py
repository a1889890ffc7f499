"""The router's process groups on gloo processes, against one process holding every token: the
balancing losses with each sequence split over a ``reduce_group`` (sequence / context parallel),
global_aux_loss and the expert-bias counts over a ``global_group``, and the logged values reduced over
pipeline (sum of the stages' layers) and data-parallel (average) ranks."""

from __future__ import annotations

import torch

from dist_harness import run_workers

E, H, B, S = 4, 4, 2, 6


def _config(**kw):
    from megatrain.models.common.config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=1, num_moe_experts=E,
                             moe_router_topk=2, **kw)


def _router(layer: int = 0, **kw):
    from megatrain.models.common.moe.router import TopKRouter

    r = TopKRouter(_config(**kw), layer)
    with torch.no_grad():
        r.weight.copy_(torch.linspace(-1.0, 1.0, E * H).reshape(E, H).sin())
    return r


def _inputs(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, H, generator=g)


def _grad_and_logged(router, x):
    x = x.clone().requires_grad_()
    probs, _ = router(x)
    (probs * 0).sum().backward()
    return x.grad, {k: v.clone() for k, v in router.logged.items()}


def _sequence_split(rank: int, world: int) -> dict[str, bool]:
    """Ranks (0, 1) and (2, 3) each split every sequence in two halves (a reduce group)."""
    import torch.distributed as dist

    from megatrain.models.common.moe.metrics import MoEMetrics

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group, half = groups[rank // 2], rank % 2
    out: dict[str, bool] = {}
    kinds = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
    for kind, name in kinds.items():
        cfg = dict(moe_aux_loss_coeff=0.1, moe_router_load_balancing_type=kind, moe_z_loss_coeff=0.01)
        x = _inputs(rank // 2)
        whole_grad, whole_logged = _grad_and_logged(_router(**cfg), x)
        r = _router(**cfg)
        r.reduce_group = group
        part = x[:, half * S // 2:(half + 1) * S // 2]
        grad, _ = _grad_and_logged(r, part)
        out[f"{kind} gradient"] = torch.allclose(grad, whole_grad[:, half * S // 2:(half + 1) * S // 2], atol=1e-7)
        metrics = MoEMetrics([r], r.config)
        metrics.after_backward(1)
        report = metrics.read(interval=True)["interval"]  # no pp / dp groups: the stage's reduction only
        out[f"{kind} logged"] = abs(report.per_layer[name][0] - whole_logged[name].item()) < 1e-6
        out["z_loss logged"] = abs(report.per_layer["z_loss"][0] - whole_logged["z_loss"].item()) < 1e-6
    return out


def _global_counts(rank: int, world: int) -> dict[str, bool]:
    """global_aux_loss and the expert bias with the tokens of two micro-batches over the world."""
    import torch.distributed as dist

    from megatrain.models.common.moe.router import update_expert_biases

    out: dict[str, bool] = {}
    xs = [_inputs(10 + m * world + q) for m in range(2) for q in range(world)]  # micro-batch m of rank q
    r = _router(moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="global_aux_loss")
    r.global_group = dist.group.WORLD
    grads = [_grad_and_logged(r, xs[m * world + rank])[0] for m in range(2)]
    # one process: micro-batch m is every rank's m-th together; the counts run over both micro-batches
    one = _router(moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="global_aux_loss")
    for m in range(2):
        x = torch.cat(xs[m * world:(m + 1) * world]).requires_grad_()
        probs, _ = one(x)
        (probs * 0).sum().backward()
        mine = x.grad[rank * B:(rank + 1) * B]
        # the loss of all tokens is the sum of the ranks' losses
        out[f"global micro-batch {m}"] = torch.allclose(grads[m], mine, atol=1e-7)
    b = _router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    b.global_group = dist.group.WORLD
    b(xs[rank])
    counts = b.local_tokens_per_expert.clone()
    dist.all_reduce(counts)
    update_expert_biases(b)
    out["bias"] = torch.equal(b.expert_bias, 1e-3 * torch.sign(counts.mean() - counts))
    return out


def _pp_dp(rank: int, world: int) -> list[float]:
    """pp 2 x dp 2: stage rank // 2 holds layer rank // 2; the data-parallel ranks' values differ."""
    import torch.distributed as dist

    from megatrain.models.common.moe.metrics import reduce_layer_values

    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    values = torch.zeros(2, 2)  # [names, layers]
    values[:, rank // 2] = torch.tensor([1.0, 10.0]) * (rank + 1)
    out = reduce_layer_values(values, ("load_balancing_loss", "z_loss"), [_router(rank // 2)],
                              pp_group=pp_groups[rank % 2], dp_group=dp_groups[rank // 2])
    return out.flatten().tolist()


def _all(rank: int, world: int) -> tuple[dict[str, bool], dict[str, bool], list[float]]:
    return _sequence_split(rank, world), _global_counts(rank, world), _pp_dp(rank, world)


def test_router_groups_and_metric_reduction():
    """One job of 4 processes (their start-up dominates): the losses over a sequence split match one
    process; global_aux_loss and the expert bias count the world's tokens; the logged values sum over
    the pipeline stages and average over the data-parallel ranks."""
    expected = [1.5, 3.5, 15.0, 35.0]  # layer 0: mean of ranks 0, 1; layer 1: of ranks 2, 3
    for rank, (split, counts, reduced) in enumerate(run_workers(_all, 4)):
        assert all(split.values()), (rank, split)
        assert all(counts.values()), (rank, counts)
        assert reduced == expected, (rank, reduced)
